"""Patches on yamux flow control: receive-window credit returned in batches, and the
PY_YAMUX_* tuning variables read once per process.

- py-libp2p 0.8.1 sends a WINDOW_UPDATE after every read: by default for the bytes read
  (`PY_YAMUX_RELEASE_ON_READ`), and, with that off, still whenever any credit is owed below
  the half-window threshold. Counted in a client's libp2p thread during an 8-client
  broadcast: 160 of the 344 frames it wrote were window updates, for 219 reads; each is a
  Noise encryption and a socket write here, and a frame-loop pass and a decryption at the
  peer. `YamuxStream._auto_tune_and_send_window_update` is replaced (process-wide) by
  go-yamux semantics: one update once half the stream's target window was read. A stream
  that has read BULK_AFTER_BYTES grows to BULK_RECV_WINDOW (py-libp2p grows it only when
  reads come within 4 RTTs, which a loopback or LAN RTT of ~0.1 ms never allows).
- py-libp2p 0.8.1 reads its PY_YAMUX_* variables from the environment on every stream read
  and window update (`os.getenv`, several per 64 KiB message per hop: ~2% of the CPU of an
  8-peer gossip run). `_py_yamux_env` is memoised."""

from __future__ import annotations

import functools

import libp2p.stream_muxer.yamux.yamux as yamux_mod

from .registry import Patch, has_signature, register, replace

BATCHING = register(Patch(
    name="yamux_window_update_batching",
    scope="process",
    targets=("libp2p.stream_muxer.yamux.yamux:YamuxStream._auto_tune_and_send_window_update",),
    why="a WINDOW_UPDATE frame after every stream read (a Noise message and a socket write "
        "each)",
    upstream="introduced by py-libp2p PR #1269 (#1270, window auto-tuning, 2026-03); no "
             "issue on the per-read updates (searched 2026-09)",
    shape=lambda: (has_signature(yamux_mod.YamuxStream, "_auto_tune_and_send_window_update",
                                 ("self", "bytes_read"), coroutine=True)
                   + has_signature(yamux_mod.YamuxStream, "send_window_update",
                                   ("self", "increment", "skip_lock"), coroutine=True)),
    fingerprints={"libp2p.stream_muxer.yamux.yamux:"
                  "YamuxStream._auto_tune_and_send_window_update": "423734321e638cb2"},
))
ENV_ONCE = register(Patch(
    name="yamux_env_read_once",
    scope="process",
    targets=("libp2p.stream_muxer.yamux.yamux:_py_yamux_env",),
    why="os.getenv on every yamux read and window update",
    upstream="none filed (searched 2026-09)",
    shape=lambda: has_signature(yamux_mod, "_py_yamux_env", ("name", "default")),
))

BULK_RECV_WINDOW = 4 * 1024 * 1024
"""Receive window a stream grants once it has read BULK_AFTER_BYTES: a 4 MiB shard then
needs two window updates, not 16+ round trips of credit. Bounded: a peer can only send what
we granted, and yamux_buffers caps what is buffered per stream and connection."""
BULK_AFTER_BYTES = 64 * 1024
"""Bytes a stream reads before it grows to BULK_RECV_WINDOW. Below it (requests, gossip)
the 256 KiB start window is never half consumed, so no WINDOW_UPDATE is sent at all."""


def install() -> None:
    replace(yamux_mod.YamuxStream, "_auto_tune_and_send_window_update", batched_window_update)
    if not isinstance(yamux_mod._py_yamux_env, functools._lru_cache_wrapper):
        replace(yamux_mod, "_py_yamux_env",
                functools.lru_cache(maxsize=64)(yamux_mod._py_yamux_env))


async def batched_window_update(self, *, bytes_read: int = 0) -> None:
    """After a read of `bytes_read` bytes: grant the credit consumed since the last grant
    if it reached half the target window. The sender always keeps at least half the window
    of credit while we keep reading, so it never waits on us for more than that."""
    grant = 0
    async with self.window_lock:
        consumed = getattr(self, "_bytes_consumed", 0) + bytes_read
        self._bytes_consumed = consumed
        if consumed >= BULK_AFTER_BYTES and self.target_recv_window < BULK_RECV_WINDOW:
            self.target_recv_window = BULK_RECV_WINDOW
        buffered = len(self.conn.stream_buffers.get(self.stream_id, b""))
        owed = self.target_recv_window - (self.recv_window + buffered)
        if owed > 0 and owed >= self.target_recv_window // 2:
            self.recv_window += owed
            grant = owed
    if grant:
        await self.send_window_update(grant, skip_lock=True)
