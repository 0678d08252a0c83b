"""Errors of the bulk plane."""

from __future__ import annotations

from ..errors import P2PError


class BulkError(P2PError):
    """A bulk-plane connection failed. `reason`: timeout, short_read, broken, tls_error (a
    record failed its integrity check: bytes changed on the path), refused (the peer is
    banned or cut), short_file."""

    reason = "bulk_error"


class BulkUnavailable(BulkError):
    """The peer's bulk plane cannot be used (none, unreachable, wrong identity, refused):
    use libp2p streams for it."""

    reason = "unavailable"


class BulkBusy(BulkError):
    """The peer's bulk plane is at its connection limits for us now: use the connections
    already open, or libp2p this time."""

    reason = "busy"
