"""Patch: pubsub reads each RPC from a per-stream buffer, not one byte per read.

py-libp2p 0.8.1's pubsub reader takes each RPC's varint length one byte per stream read,
then the body in frame-sized reads; every read goes through three locks and the yamux
window logic. The replacement of the module's `read_varint_prefixed_bytes_limited`
(process-wide; pubsub is its only user there) takes whatever the stream holds (bounded: up
to the current RPC's size, or READ_CHUNK while the length is not known) and cuts RPCs from
a per-stream buffer. Same errors: ParseError on an over-long varint, MessageTooLarge on the
length prefix (before the body is read), IncompleteReadError at a short end."""

from __future__ import annotations

import libp2p.pubsub.pubsub as pubsub_mod
from libp2p.exceptions import ParseError
from libp2p.io.exceptions import IncompleteReadError, MessageTooLarge
from libp2p.utils.varint import decode_uvarint

from .registry import Patch, has_signature, register, replace

PATCH = register(Patch(
    name="buffered_rpc_reader",
    scope="process",
    targets=("libp2p.pubsub.pubsub:read_varint_prefixed_bytes_limited",),
    why="the varint length of every RPC is read one byte per stream read",
    upstream="none filed (searched 2026-09)",
    shape=lambda: has_signature(pubsub_mod, "read_varint_prefixed_bytes_limited",
                                ("reader", "max_length"), coroutine=True),
    fingerprints={"libp2p.utils.varint:read_varint_prefixed_bytes_limited": "e6ce5af1f5215a05"},
))

READ_CHUNK = 64 * 1024


def install() -> None:
    replace(pubsub_mod, "read_varint_prefixed_bytes_limited", read_rpc)


async def read_rpc(stream, max_length: int) -> bytes:
    """`read_varint_prefixed_bytes_limited` over a per-stream buffer."""
    buf: bytearray | None = getattr(stream, "_swarm_rbuf", None)
    if buf is None:
        buf = stream._swarm_rbuf = bytearray()
    while True:
        length, header = _parse_length(buf, max_length)
        if length is not None and len(buf) >= header + length:
            rpc = bytes(buf[header:header + length])
            del buf[:header + length]
            return rpc
        want = READ_CHUNK if length is None else header + length - len(buf)
        chunk = await stream.read(max(want, READ_CHUNK) if length is None else want)
        if not chunk:
            raise IncompleteReadError(f"stream ended {len(buf)} bytes into an RPC",
                                      expected_bytes=header + (length or 1),
                                      received_bytes=len(buf))
        buf += chunk


def _parse_length(buf: bytearray, max_length: int) -> tuple[int | None, int]:
    """(RPC length, varint size), or (None, 0) while the varint is incomplete."""
    for i in range(min(len(buf), 10)):
        if buf[i] & 0x80 == 0:
            length = decode_uvarint(bytes(buf[:i + 1]))
            if length > max_length:
                raise MessageTooLarge(f"Message length {length} exceeds maximum allowed "
                                      f"{max_length}")
            return length, i + 1
    if len(buf) >= 10:
        raise ParseError("Varint decoding error: integer exceeds maximum size of 64 bits")
    return None, 0
