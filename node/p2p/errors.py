"""Errors of the peer-to-peer layer. All derive from NodeError so the CLI prints them
without a traceback; `reason` is a short stable code (NODE_SPEC.md lists them)."""

from __future__ import annotations

from ..errors import NodeError


class P2PError(NodeError):
    """Root of all peer-to-peer faults."""

    reason = "p2p_error"

    def __init__(self, message: str, *, reason: str | None = None):
        super().__init__(message)
        if reason is not None:
            self.reason = reason


class NotRunning(P2PError):
    """The node is not started, or already closed."""

    reason = "not_running"


class DialError(P2PError):
    """A peer could not be reached: refused, timeout, wrong peer ID, protocol mismatch."""

    reason = "dial_failed"


class BootstrapError(P2PError):
    """No bootstrap peer could be reached within the configured time."""

    reason = "bootstrap_failed"


class StreamError(P2PError):
    """A stream could not be opened, or broke while in use."""

    reason = "stream_error"


class RequestError(P2PError):
    """A request failed: timeout, too large, busy, remote error, or a broken stream."""

    reason = "request_failed"


class PublishError(P2PError):
    """A gossip message could not be published (too large, no capacity in time)."""

    reason = "publish_failed"


class BadMultiaddr(P2PError):
    """A multiaddr string does not parse or lacks the /p2p/<peer id> part."""

    reason = "bad_multiaddr"
