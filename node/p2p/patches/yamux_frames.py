"""Patches on yamux framing: frames sized as whole Noise messages, frame reads without two
copies, and frame writes without a debug line formatted for nothing.

- py-libp2p 0.8.1 sends DATA frames of 65536 bytes (12-byte header included), which its
  Noise layer (65519 bytes of plaintext per message) splits into a full message and a
  17-byte one: every 64 KiB of stream data cost two encryptions, two socket writes, and two
  reads and decryptions at the peer. `MAX_MESSAGE_SIZE` (a frame, header included) becomes
  FRAME_MESSAGES whole Noise messages (~1.06 MiB: one frame-loop pass per MiB; frames
  never exceed the window the peer granted). Frames the peer sends are accepted as before.
- `read_exactly` (the module's import, used for frame headers and bodies) copies every body
  twice (bytearray, then bytes) even when one read returned it all.
- `Yamux._write_frame` unpacks every frame's header and formats an f-string for a debug
  line even when debug logging is off; with debug on, py-libp2p's own method runs."""

from __future__ import annotations

import logging

import libp2p.stream_muxer.yamux.yamux as yamux_mod
import trio
from libp2p.io.exceptions import IncompleteReadError
from libp2p.security.noise.io import MAX_PLAINTEXT_LENGTH

from .registry import Patch, has_signature, original, register, replace, sets_attribute

FRAMES = register(Patch(
    name="yamux_frames_fit_noise",
    scope="process",
    targets=("libp2p.stream_muxer.yamux.yamux:MAX_MESSAGE_SIZE",),
    why="a full 64 KiB yamux frame is two Noise messages (a full one and 17 bytes)",
    upstream="none filed (searched 2026-09)",
    shape=lambda: ([] if isinstance(original(yamux_mod, "MAX_MESSAGE_SIZE"), int)
                   else ["yamux MAX_MESSAGE_SIZE is not an int"]),
))
READ_EXACTLY = register(Patch(
    name="yamux_read_exactly_one_copy",
    scope="process",
    targets=("libp2p.stream_muxer.yamux.yamux:read_exactly",),
    why="every yamux frame body is copied twice on the way in",
    upstream="none filed (searched 2026-09)",
    shape=lambda: has_signature(yamux_mod, "read_exactly", ("reader", "n", "retry_count"),
                                coroutine=True),
    fingerprints={"libp2p.io.utils:read_exactly": "c02de7be0cb4bb0b"},
))
WRITE_FRAME = register(Patch(
    name="yamux_write_frame_quiet",
    scope="process",
    targets=("libp2p.stream_muxer.yamux.yamux:Yamux._write_frame",),
    why="every frame written unpacks its header and formats a debug line with debug off",
    upstream="none filed (searched 2026-09)",
    shape=lambda: (has_signature(yamux_mod.Yamux, "_write_frame", ("self", "data"),
                                 coroutine=True)
                   + sets_attribute(yamux_mod.Yamux, "_write_lock")),
    fingerprints={"libp2p.stream_muxer.yamux.yamux:Yamux._write_frame": "f24f22de9623027c"},
))

FRAME_MESSAGES = 17
"""Yamux DATA frames carry up to this many Noise messages (header + payload <= k x 65519
bytes, ~1.06 MiB). 17, not 16: a 1 MiB write (the shard chunk) plus its 12-byte header
then fits one frame; at 16 it went out as a frame of 1 MiB - 272 bytes and one of 272."""


def install() -> None:
    replace(yamux_mod, "MAX_MESSAGE_SIZE", FRAME_MESSAGES * MAX_PLAINTEXT_LENGTH)
    replace(yamux_mod, "read_exactly", read_exactly_once)
    replace(yamux_mod.Yamux, "_write_frame", write_frame)


async def read_exactly_once(reader, n: int, retry_count: int = 100) -> bytes:
    """py-libp2p's read_exactly without its two copies when one read returns it all."""
    data = await reader.read(n)
    if len(data) == n:
        return data
    buf = bytearray(data)
    for _ in range(retry_count):
        if len(buf) >= n:
            return bytes(buf)
        more = await reader.read(n - len(buf))
        if not more:
            break
        buf.extend(more)
    if len(buf) >= n:
        return bytes(buf)
    raise IncompleteReadError(f"connection closed: expected {n} bytes, received {len(buf)}",
                              expected_bytes=n, received_bytes=len(buf))


async def write_frame(self, data: bytes) -> None:
    """Yamux._write_frame without the debug formatting (py-libp2p's runs with debug on)."""
    if yamux_mod.logger.isEnabledFor(logging.DEBUG):
        return await original(yamux_mod.Yamux, "_write_frame")(self, data)
    async with self._write_lock:
        await self.secured_conn.write(data)
    await trio.lowlevel.checkpoint()
