"""Enforce the yamux receive window (trio side; py-libp2p 0.8.1 only logs a violation).

py-libp2p appends every DATA frame to the stream's buffer and, when the peer exceeded the
window it was granted, logs a warning and carries on, so a peer that ignores flow control
fills our memory (384 MiB pushed in 8 s raised a victim's RSS by 386 MiB). Each connection's
`stream_buffers` dict is replaced, as the connection opens, by one whose buffers refuse to
grow past MAX_STREAM_BUFFER per stream or MAX_CONN_BUFFER per connection: the frame is
dropped, the stream marked broken by py-libp2p's own error path, and `on_violation(peer)`
penalises the peer (which cuts the connection).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import libp2p.stream_muxer.yamux.yamux as yamux_mod
from libp2p.security.noise.io import MAX_PLAINTEXT_LENGTH

from ...protocol.limits import MAX_CONN_BUFFER, MAX_STREAM_BUFFER

log = logging.getLogger(__name__)


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


def bound_buffers(muxed_conn, peer: str, on_violation: Callable[[str, int], None]) -> bool:
    """Install BoundedBuffers on a yamux connection; False if it is not one we know."""
    buffers = getattr(muxed_conn, "stream_buffers", None)
    if buffers is None or isinstance(buffers, BoundedBuffers):
        return buffers is not None
    bounded = BoundedBuffers({}, peer, on_violation)
    for sid, buf in list(buffers.items()):
        bounded[sid] = buf  # copies: readers look the buffer up again on each read
    muxed_conn.stream_buffers = bounded
    return True


def install_window_update_batching() -> None:
    """Return receive-window credit in batches (go-yamux semantics: once half the window is
    consumed) instead of py-libp2p 0.8.1's default of a WINDOW_UPDATE frame after every
    read (`PY_YAMUX_RELEASE_ON_READ`, default on): on a 64 KiB gossip message that default
    cost ~4 extra encrypted frames each way, per message per hop. Idempotent, per process."""
    yamux_mod._yamux_release_on_read = _release_on_read_off


def _release_on_read_off() -> bool:
    return False


def freeze_tuning_env() -> None:
    """py-libp2p 0.8.1 reads its PY_YAMUX_* tuning variables from the environment on every
    stream read and window update (os.getenv, several per 64 KiB gossip message per hop:
    ~2% of the CPU of an 8-peer gossip run). Read each once per process instead.
    Idempotent."""
    if isinstance(yamux_mod._py_yamux_env, functools._lru_cache_wrapper):
        return
    yamux_mod._py_yamux_env = functools.lru_cache(maxsize=64)(yamux_mod._py_yamux_env)


def fit_frames_to_noise() -> None:
    """Cap a yamux frame (12-byte header + payload) at one Noise message (65519 bytes of
    plaintext). py-libp2p 0.8.1 sends 65536-byte frames, which its Noise layer splits into a
    full message and a 17-byte one: every 64 KiB of stream data cost two encryptions, two
    socket writes, and two reads and decryptions at the peer (measured on one 128 MiB
    stream between two nodes: about 20% less CPU with the cap). Frames the peer sends are
    accepted as before. Idempotent, per process."""
    yamux_mod.MAX_MESSAGE_SIZE = MAX_PLAINTEXT_LENGTH
