"""The shard protocol (`SHARD_PROTOCOL`; NODE_SPEC 7.2).

    client -> server: u32 big-endian length + ShardRequest (msgpack, <= 1 KiB)
    server -> client: u32 big-endian length + ShardResponseHeader (msgpack, <= 1 KiB)
                      then, if ok, exactly `length` raw bytes.

After a complete shard the server waits up to `request_timeout_s` for another request on the
same stream (libp2p) or connection (bulk plane); after an error answer other than `seeded`
it closes. A client
may send its next request once it read the whole response, or close.

Error codes in the header: bad_request, bad_range, unknown_shard, busy, internal, and
seeded (a trainer's shard that the swarm carries: seeding.py), after which the stream stays
open.
"""

from __future__ import annotations

import asyncio
import logging
import struct
from collections.abc import AsyncIterator, Callable
from typing import Protocol

from ...protocol.errors import ProtocolError
from ...protocol.limits import Limits
from ...protocol.messages import ShardRequest, ShardResponseHeader
from .errors import ShardFetchError

log = logging.getLogger(__name__)
FRAME_HEADER = struct.Struct(">I")
MAX_CONTROL_FRAME = 1024
CLOSE_TIMEOUT_S = 2.0  # closing a stream: a broken one may never answer


class ByteStream(Protocol):
    """What the shard protocol needs from a stream (libp2p, TCP or in-memory)."""

    async def read(self, n: int) -> bytes: ...  # b"" at end of stream
    async def readexactly(self, n: int) -> bytes: ...
    async def write(self, data: bytes) -> None: ...
    async def close(self) -> None: ...


class ShardTransport(Protocol):
    """Opens a stream to a peer's shard server."""

    async def open(self, peer: str) -> ByteStream: ...
    # a transport that pools streams (sets `reused` on them) also takes `fresh=True`: open a
    # new stream, never a pooled one


async def write_frame(stream: ByteStream, payload: bytes) -> None:
    await stream.write(FRAME_HEADER.pack(len(payload)) + payload)


async def read_frame(stream: ByteStream, max_size: int = MAX_CONTROL_FRAME) -> bytes:
    (n,) = FRAME_HEADER.unpack(await stream.readexactly(FRAME_HEADER.size))
    if n > max_size:
        raise ShardFetchError(f"frame of {n} bytes exceeds {max_size}", reason="bad_frame")
    return await stream.readexactly(n)


async def _open(transport: ShardTransport, peer: str, timeout: float,
                fresh: bool = False) -> ByteStream:
    try:
        opening = transport.open(peer, fresh=True) if fresh else transport.open(peer)
        async with asyncio.timeout(timeout):
            return await opening
    except Exception as e:
        raise ShardFetchError(f"{peer}: cannot open stream: {e!r}", reason="open_failed") from e


async def _close(stream: ByteStream, peer: str) -> None:
    try:
        async with asyncio.timeout(CLOSE_TIMEOUT_S):
            await stream.close()
    except Exception as e:  # noqa: BLE001 - closing a broken stream may fail
        log.debug("closing the stream to %s failed: %r", peer, e)


async def _request(stream: ByteStream, peer: str, request: ShardRequest, expected_len: int,
                   timeout: float) -> None:
    """Send the request, check the response header announces `expected_len` bytes."""
    try:
        async with asyncio.timeout(timeout):
            await write_frame(stream, request.encode())
        async with asyncio.timeout(timeout):
            raw = await read_frame(stream)
        header = ShardResponseHeader.decode(raw, max_size=Limits().max_for("shard_response"))
    except TimeoutError as e:
        raise ShardFetchError(f"{peer}: no response header", reason="timeout") from e
    except ProtocolError as e:
        raise ShardFetchError(f"{peer}: bad response header: {e}", reason="bad_header") from e
    except ShardFetchError:
        raise
    except Exception as e:
        raise ShardFetchError(f"{peer}: {e!r}", reason="short_read") from e
    if not header.ok:
        if header.error == "seeded":  # the server keeps the stream for the next request
            _reusable(stream)
        raise ShardFetchError(f"{peer}: {header.error}", reason=header.error or "refused")
    if header.length != expected_len:
        raise ShardFetchError(f"{peer}: announces {header.length} bytes, expected "
                              f"{expected_len}", reason="bad_header")


async def _open_request(transport: ShardTransport, peer: str, request: ShardRequest,
                        expected_len: int, timeout: float) -> ByteStream:
    """A stream on which `request` was sent and its header checked. A pooled stream that
    the server ended meanwhile (it serves one request per stream, or the stream idled past
    its bound) fails before any header byte: that is not the source's fault, so the request
    is sent once more on a fresh stream (never another pooled one: another transfer may
    have just put a stream the server also ended back in the pool)."""
    for retried in (False, True):
        stream = await _open(transport, peer, timeout, fresh=retried)
        try:
            await _request(stream, peer, request, expected_len, timeout)
            return stream
        except BaseException as e:
            await _close(stream, peer)
            stale = (isinstance(e, ShardFetchError) and getattr(stream, "reused", False)
                     and e.reason in ("short_read", "timeout"))
            if retried or not stale:
                raise
        forget = getattr(transport, "forget_idle", None)
        if forget is not None:
            forget(peer)
    raise AssertionError("unreachable: the second attempt returns or raises")


def _reusable(stream: ByteStream) -> None:
    """The whole response was read: the stream may carry another request (if pooled)."""
    reusable = getattr(stream, "reusable", None)
    if reusable is not None:
        reusable()


async def _chunks(stream: ByteStream, peer: str, length: int, chunk_timeout: float,
                  chunk_size: int) -> AsyncIterator[bytes]:
    left = length
    while left > 0:
        try:
            # A whole chunk per call: on libp2p each call is one crossing of the trio
            # bridge, and a yamux read returns one frame (profiled: the crossings, not
            # the bytes, bounded the stream path).
            async with asyncio.timeout(chunk_timeout):
                data = await stream.readexactly(min(chunk_size, left))
        except TimeoutError as e:
            raise ShardFetchError(f"{peer}: stalled with {left} bytes left",
                                  reason="timeout") from e
        except Exception as e:
            raise ShardFetchError(f"{peer}: {e!r}", reason="short_read") from e
        if not data:
            raise ShardFetchError(f"{peer}: stream ended with {left} bytes left",
                                  reason="short_read")
        left -= len(data)
        yield data


async def fetch(transport: ShardTransport, peer: str, request: ShardRequest, *,
                expected_len: int, request_timeout: float, chunk_timeout: float,
                chunk_size: int) -> AsyncIterator[bytes]:
    """Stream the bytes of one shard request from `peer`. Any failure is a ShardFetchError
    whose reason names it (open_failed, timeout, short_read, bad_header, or the server's
    error code); the stream is always closed."""
    stream = await _open_request(transport, peer, request, expected_len, request_timeout)
    try:
        async for data in _chunks(stream, peer, expected_len, chunk_timeout, chunk_size):
            yield data
        _reusable(stream)
    finally:
        await _close(stream, peer)


async def fetch_into(transport: ShardTransport, peer: str, request: ShardRequest,
                     sink: Callable[[memoryview | bytes], None], *, expected_len: int,
                     request_timeout: float, chunk_timeout: float, chunk_size: int) -> None:
    """`fetch`, but the bytes go to `sink` (blocking: hashing and writing), always off the
    event loop: a stream with `receive_into` (the bulk plane) runs the whole body in
    one thread; others hop to a thread per chunk. Failures as in `fetch`; what `sink`
    raises passes through."""
    stream = await _open_request(transport, peer, request, expected_len, request_timeout)
    try:
        receive_into = getattr(stream, "receive_into", None)
        if receive_into is not None:
            try:
                await receive_into(expected_len, sink, chunk_timeout, chunk_size)
            except ShardFetchError as e:
                raise ShardFetchError(f"{peer}: {e}", reason=e.reason) from e
            _reusable(stream)
            return
        async for data in _chunks(stream, peer, expected_len, chunk_timeout, chunk_size):
            await asyncio.to_thread(sink, data)
        _reusable(stream)
    finally:
        await _close(stream, peer)
