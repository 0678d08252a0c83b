"""Patch: the yamux receive window is enforced (py-libp2p 0.8.1 only logs a violation).

py-libp2p appends every DATA frame to the stream's buffer and, when the peer exceeded the
window it was granted, logs a warning and carries on, so a peer that ignores flow control
fills our memory (384 MiB pushed in 8 s raised a victim's RSS by 386 MiB). Each connection's
`stream_buffers` dict is replaced, as the connection opens, by one whose buffers refuse to
grow past MAX_STREAM_BUFFER per stream or MAX_CONN_BUFFER per connection: the frame is
dropped, the stream marked broken by py-libp2p's own error path, and `on_violation(peer, n)`
penalises the peer (which cuts the connection). Slices of a buffer come out as bytes copied
once (py-libp2p reads `bytes(buffer[:n])`, which copied every received byte twice)."""

from __future__ import annotations

import logging
from collections.abc import Callable

from libp2p.stream_muxer.yamux.yamux import Yamux

from ....protocol.limits import MAX_CONN_BUFFER, MAX_STREAM_BUFFER
from .registry import Patch, register, sets_attribute

log = logging.getLogger(__name__)

PATCH = register(Patch(
    name="yamux_receive_window_enforced",
    scope="connection",
    targets=("libp2p.stream_muxer.yamux.yamux:Yamux.stream_buffers",),
    why="data beyond the granted receive window is buffered anyway: unbounded memory",
    upstream="none filed for py-libp2p (searched 2026-09); rust-yamux and go-yamux reset "
             "the stream or connection (rust-libp2p #1257, hashicorp/yamux #4)",
    shape=lambda: sets_attribute(Yamux, "stream_buffers"),
))


class WindowViolation(Exception):
    """A peer sent more than the receive window allows."""


class BoundedBuffer(bytearray):
    """A yamux stream buffer that raises instead of growing past the limits."""

    owner: BoundedBuffers

    def extend(self, data) -> None:
        n = len(data)
        if len(self) + n > self.owner.max_stream or self.owner.total() + n > self.owner.max_conn:
            self.owner.violated(n)
            raise WindowViolation(f"peer exceeded the receive window by sending {n} bytes "
                                  f"onto {len(self)} buffered")
        super().extend(data)

    def __getitem__(self, key):
        if isinstance(key, slice):
            with memoryview(self) as view:
                return bytes(view[key])
        return super().__getitem__(key)


class BoundedBuffers(dict):
    """Stands in for `Yamux.stream_buffers`."""

    def __init__(self, initial: dict, peer: str, on_violation: Callable[[str, int], None], *,
                 max_stream: int = MAX_STREAM_BUFFER, max_conn: int = MAX_CONN_BUFFER):
        super().__init__(initial)
        self.peer = peer
        self.on_violation = on_violation
        self.max_stream = max_stream
        self.max_conn = max_conn
        self.dropped = 0

    def __setitem__(self, stream_id, buf) -> None:
        if not isinstance(buf, BoundedBuffer):
            bounded = BoundedBuffer(buf)
            bounded.owner = self
            buf = bounded
        super().__setitem__(stream_id, buf)

    def total(self) -> int:
        return sum(len(b) for b in list(self.values()))

    def violated(self, n: int) -> None:
        first = self.dropped == 0
        self.dropped += n
        if first:
            log.warning("peer %s ignored the yamux receive window; dropping its data and "
                        "cutting the connection", self.peer)
        self.on_violation(self.peer, n)


def patch_stream_buffers(muxed_conn, peer: str,
                         on_violation: Callable[[str, int], None]) -> bool:
    """Install BoundedBuffers on a yamux connection; False if it is not one we know."""
    buffers = getattr(muxed_conn, "stream_buffers", None)
    if buffers is None or isinstance(buffers, BoundedBuffers):
        return buffers is not None
    bounded = BoundedBuffers({}, peer, on_violation)
    for sid, buf in list(buffers.items()):
        bounded[sid] = buf  # copies: readers look the buffer up again on each read
    muxed_conn.stream_buffers = bounded
    return True
