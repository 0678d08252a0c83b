"""Errors of the broadcast package. Each carries a stable `reason` code (NODE_SPEC.md §7)."""

from __future__ import annotations

from ..errors import NodeError


class BroadcastError(NodeError):
    """Root of broadcast failures."""

    reason = "broadcast_error"

    def __init__(self, message: str, *, reason: str | None = None):
        super().__init__(message)
        if reason is not None:
            self.reason = reason


class ManifestRejected(BroadcastError):
    """A checkpoint manifest was not accepted; `reason` says why."""

    reason = "manifest_rejected"


class ShardFetchError(BroadcastError):
    """One shard transfer from one source failed (error answer, timeout, short read, bad hash)."""

    reason = "fetch_failed"


class DownloadFailed(BroadcastError):
    """A version could not be completed (no usable source left, stalled, or whole-hash mismatch)."""

    reason = "download_failed"


class StoreError(BroadcastError):
    """The on-disk shard store is inconsistent or a write failed."""

    reason = "store_error"
