"""Streams over libp2p (Noise + Yamux): an asyncio-facing stream object and the
length-prefixed request/response protocol.

Request/response framing on one stream per request:
  request:  u32 big-endian length, then that many bytes
  response: u8 status, u32 big-endian length, then that many bytes
Status codes: 0 ok (body = response), 1 error (body = UTF-8 message), 2 busy (too many
requests from this peer in flight), 3 too_large (request above the server's limit),
4 no_handler. The server closes the stream after the response.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import struct
import threading
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Self

import trio
from libp2p.network.stream.exceptions import StreamEOF, StreamReset

from .bridge import TrioBridge
from .errors import NotRunning, RequestError, StreamError
from .metrics import P2PMetrics

log = logging.getLogger(__name__)

STATUS_OK, STATUS_ERROR, STATUS_BUSY, STATUS_TOO_LARGE, STATUS_NO_HANDLER = range(5)
STATUS_REASONS = {STATUS_ERROR: "remote_error", STATUS_BUSY: "busy",
                  STATUS_TOO_LARGE: "too_large", STATUS_NO_HANDLER: "no_handler"}
_LEN = struct.Struct(">I")
_RESP = struct.Struct(">BI")
MAX_ERROR_TEXT = 1024


# trio side -------------------------------------------------------------------------------

async def read_exactly(stream, n: int) -> bytes:
    """Read exactly n bytes from a libp2p stream; StreamError(reason="eof") if it ends."""
    parts: list[bytes] = []
    got = 0
    while got < n:
        try:
            chunk = await stream.read(min(n - got, 1 << 20))
        except StreamEOF:
            chunk = b""
        except StreamReset as e:
            raise StreamError("the peer reset the stream", reason="reset") from e
        if not chunk:
            raise StreamError(f"stream ended after {got} of {n} bytes", reason="eof")
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


async def read_some(stream, n: int) -> bytes:
    """Up to n bytes; b"" at end of stream."""
    try:
        return await stream.read(n)
    except StreamEOF:
        return b""
    except StreamReset as e:
        raise StreamError("the peer reset the stream", reason="reset") from e


async def receive_into(stream, n: int, sink: Callable[[bytes], None], chunk_timeout: float,
                       chunk_size: int) -> None:
    """Exactly n bytes from a libp2p stream into the blocking `sink`, run in a worker
    thread per chunk (hashing and writing leave both event loops) while the trio thread
    keeps receiving: one bridge crossing per transfer instead of an asyncio -> trio ->
    asyncio crossing and an asyncio -> thread hop per chunk (measured in the libp2p-only
    broadcast benchmark: a client's asyncio thread 0.6 -> 0.3 CPU-s per 256 MiB).
    StreamError(reason="timeout") if nothing arrives for `chunk_timeout`, reason "eof" if
    the stream ends first; what `sink` raises passes through."""
    left = n
    while left > 0:
        data = None
        with trio.move_on_after(chunk_timeout):  # the read only: a slow disk is no stall
            data = await read_some(stream, min(left, chunk_size))
        if data is None:
            raise StreamError(f"stalled with {left} bytes left", reason="timeout")
        if not data:
            raise StreamError(f"stream ended with {left} bytes left", reason="eof")
        left -= len(data)
        await trio.to_thread.run_sync(sink, data)


SEND_FILE_CHUNK = 1 << 20
DEAD_CLOSE_S = 5.0  # the most a close, disconnect or reset may take (a dead path: forever)
STREAM_CLOSE_S = 2.0  # a stream's close (a FIN frame); a failed one is reset instead


async def send_file(stream, path, offset: int, count: int) -> None:
    """Write `count` bytes of the file at `path` from `offset` to a libp2p stream, all in
    the trio thread: one bridge crossing per file range instead of one per chunk, and the
    file read into one reused buffer (yamux copies each frame out of it before the write
    returns). The reads block this thread: they are meant for files just written and
    verified (checkpoint shards, in the page cache; ~0.1 ms per MiB)."""
    buf = memoryview(bytearray(min(SEND_FILE_CHUNK, count)))
    fd = os.open(path, os.O_RDONLY)
    try:
        done = 0
        while done < count:
            k = os.preadv(fd, [buf[:min(len(buf), count - done)]], offset + done)
            if k <= 0:
                raise StreamError(f"{path} ended {count - done} bytes early", reason="eof")
            await write_all(stream, buf[:k])
            done += k
    finally:
        os.close(fd)


async def write_all(stream, data: bytes) -> None:
    try:
        await stream.write(data)
    except StreamReset as e:
        raise StreamError("the peer reset the stream", reason="reset") from e
    except Exception as e:
        raise StreamError(f"write failed: {type(e).__name__}: {e}", reason="write_failed") from e


async def close_quietly(stream, timeout: float = STREAM_CLOSE_S) -> None:
    """Close `stream` within `timeout` (past it, its send side counts as closed: py-libp2p
    marks it so however its FIN write ends); reset it, bounded, if the close failed."""
    with trio.move_on_after(timeout) as scope:
        try:
            await stream.close()
            return
        except Exception as e:  # noqa: BLE001 - closing a broken stream is best effort
            log.debug("stream close failed (%s); resetting", e)
    if scope.cancelled_caught:
        log.debug("stream close not done within %.0fs", timeout)
        return
    await reset_quietly(stream)


async def reset_quietly(stream, timeout: float = DEAD_CLOSE_S) -> None:
    """Reset `stream` within `timeout`; errors (already gone) are logged, never raised."""
    with trio.move_on_after(timeout):
        try:
            await stream.reset()
        except Exception as e:  # noqa: BLE001 - best effort
            log.debug("stream reset failed: %s", e)


def remote_peer(stream) -> str:
    return stream.muxed_conn.peer_id.to_base58()


class PeerSlots:
    """Counts in-flight work per peer; `try_take` fails when a peer is at its limit."""

    def __init__(self, limit: int):
        self.limit = limit
        self.inflight: Counter[str] = Counter()

    def try_take(self, peer: str) -> bool:
        if self.inflight[peer] >= self.limit:
            return False
        self.inflight[peer] += 1
        return True

    def give(self, peer: str) -> None:
        self.inflight[peer] -= 1
        if self.inflight[peer] <= 0:
            del self.inflight[peer]


async def client_request(host, peer_id, protocol_id: str, payload: bytes, *,
                         timeout: float, max_response: int,
                         first_answer: float | None = None) -> bytes:
    """Open a stream, send one framed request, read one framed response (trio side).
    `first_answer`: seconds within which the response's header must arrive (the stream's
    opening included), else RequestError `timeout`."""
    stream = None
    try:
        with trio.fail_after(timeout):
            first = trio.CancelScope(deadline=trio.current_time() + first_answer
                                     if first_answer is not None else math.inf)
            with first:
                try:
                    stream = await host.new_stream(peer_id, [protocol_id])
                except Exception as e:
                    raise RequestError(f"cannot open {protocol_id} to {peer_id}: "
                                       f"{type(e).__name__}: {e}", reason="open_failed") from e
                await write_all(stream, _LEN.pack(len(payload)) + payload)
                status, length = _RESP.unpack(await read_exactly(stream, _RESP.size))
            if first.cancelled_caught:
                raise RequestError(f"{protocol_id} request to {peer_id}: no answer within "
                                   f"{first_answer:.1f}s", reason="timeout")
            limit = max_response if status == STATUS_OK else MAX_ERROR_TEXT
            if length > limit:
                raise RequestError(f"response of {length} bytes from {peer_id} exceeds "
                                   f"{limit}", reason="too_large")
            body = await read_exactly(stream, length)
    except trio.TooSlowError:
        if stream is not None:
            await reset_quietly(stream)
        raise RequestError(f"{protocol_id} request to {peer_id} timed out after {timeout:.1f}s",
                           reason="timeout") from None
    except StreamError as e:
        if stream is not None:
            await reset_quietly(stream)
        raise RequestError(f"{protocol_id} request to {peer_id} failed: {e}",
                           reason=e.reason) from e
    except RequestError:
        if stream is not None:
            await reset_quietly(stream)
        raise
    except trio.Cancelled:  # the caller gave up (a hedged pull served elsewhere): reset the
        if stream is not None:  # stream, or the muxer keeps it half-open for good
            with trio.CancelScope(shield=True, deadline=trio.current_time() + 1.0):
                await reset_quietly(stream)
        raise
    await close_quietly(stream)
    if status == STATUS_OK:
        return body
    reason = STATUS_REASONS.get(status, "remote_error")
    text = body.decode("utf-8", "replace")
    raise RequestError(f"{peer_id} answered {protocol_id} with {reason}: {text}", reason=reason)


async def serve_request(bridge: TrioBridge, stream, handler: Callable[[str, bytes],
                        Awaitable[bytes]], *, slots: PeerSlots, timeout: float,
                        max_request: int, max_response: int, metrics: P2PMetrics) -> None:
    """Trio-side stream handler for one request (the asyncio handler does the work).
    Every answer, error replies included, ends with the stream closed (or reset when
    broken), so nothing is left open for the connection's life."""
    try:
        with trio.fail_after(timeout):
            status, body = await _answer(bridge, stream, handler, slots=slots,
                                         max_request=max_request, max_response=max_response,
                                         metrics=metrics)
            await _respond(stream, status, body)
    except trio.TooSlowError:
        metrics.inc("requests_timed_out")
        await reset_quietly(stream)
        return
    except StreamError:
        metrics.inc("requests_broken")
        await reset_quietly(stream)
        return
    if status == STATUS_OK:
        metrics.inc("requests_served")
    await close_quietly(stream)


async def _answer(bridge: TrioBridge, stream, handler, *, slots: PeerSlots, max_request: int,
                  max_response: int, metrics: P2PMetrics) -> tuple[int, bytes]:
    """Read one framed request and compute (status, body) of the reply."""
    peer = remote_peer(stream)
    slot = f"{peer} {stream.get_protocol()}"  # per peer and protocol: bulk can't starve others
    (length,) = _LEN.unpack(await read_exactly(stream, _LEN.size))
    if length > max_request:
        metrics.inc("requests_too_large")
        return STATUS_TOO_LARGE, f"request of {length} bytes exceeds {max_request}".encode()
    if not slots.try_take(slot):
        metrics.inc("requests_busy")
        return STATUS_BUSY, b"too many requests in flight"
    try:
        body = await read_exactly(stream, length)
        try:
            response = await bridge.to_asyncio(handler, peer, body)
        except Exception as e:  # noqa: BLE001 - reported to the requester, counted
            metrics.inc("request_handler_errors")
            log.info("request handler for %s failed: %s: %s",
                     stream.get_protocol(), type(e).__name__, e)
            return STATUS_ERROR, f"{type(e).__name__}: {e}".encode()[:MAX_ERROR_TEXT]
    finally:
        slots.give(slot)
    if not isinstance(response, bytes | bytearray | memoryview):
        return STATUS_ERROR, b"handler returned a non-bytes response"
    if len(response) > max_response:
        return STATUS_ERROR, f"response of {len(response)} bytes exceeds {max_response}".encode()
    return STATUS_OK, bytes(response)


async def _respond(stream, status: int, body: bytes) -> None:
    await write_all(stream, _RESP.pack(status, len(body)) + body)


# asyncio side ----------------------------------------------------------------------------

class _SinkGate:
    """Calls `sink` until closed; `close()` waits for a call in flight (at most one chunk's
    hash and write) and refuses later ones."""

    def __init__(self, sink: Callable[[bytes], None]):
        self.sink = sink
        self.lock = threading.Lock()
        self.closed = False

    def __call__(self, data: bytes) -> None:
        with self.lock:
            if self.closed:
                raise StreamError("the receiver was cancelled", reason="cancelled")
            self.sink(data)

    def close(self) -> None:
        with self.lock:
            self.closed = True


class AsyncStream:
    """A libp2p stream used from asyncio. Every call runs in the trio thread.
    `max_inbound` (inbound streams: the node's `p2p.max_request_bytes`) bounds the bytes
    the peer may send on it; past it reads raise StreamError(reason="too_large")."""

    def __init__(self, bridge: TrioBridge, stream, peer_id: str, protocol_id: str, *,
                 max_inbound: int | None = None):
        self._bridge = bridge
        self._stream = stream
        self.peer_id = peer_id
        self.protocol_id = protocol_id
        self.max_inbound = max_inbound
        self.received = 0

    def _count(self, data: bytes) -> bytes:
        self.received += len(data)
        if self.max_inbound is not None and self.received > self.max_inbound:
            raise StreamError(f"{self.peer_id} sent more than {self.max_inbound} bytes on "
                              f"{self.protocol_id}", reason="too_large")
        return data

    async def read(self, n: int = 65536) -> bytes:
        """Up to n bytes; b"" at end of stream."""
        return self._count(await self._bridge.call(read_some, self._stream, n))

    async def readexactly(self, n: int) -> bytes:
        """Exactly n bytes, or StreamError(reason="eof") if the stream ends first."""
        if n < 0:
            raise ValueError("n must be >= 0")
        if n == 0:
            return b""
        if self.max_inbound is not None and self.received + n > self.max_inbound:
            raise StreamError(f"{self.peer_id} would exceed {self.max_inbound} bytes on "
                              f"{self.protocol_id}", reason="too_large")
        return self._count(await self._bridge.call(read_exactly, self._stream, n))

    async def receive_into(self, n: int, sink: Callable[[bytes], None], chunk_timeout: float,
                           chunk_size: int) -> None:
        """Exactly n bytes into the blocking `sink` (see `receive_into` above): StreamError
        if the stream stalls or ends. If the caller is cancelled, a sink call in flight ends
        before this returns and none starts after (the caller may close what sink writes)."""
        if self.max_inbound is not None and self.received + n > self.max_inbound:
            raise StreamError(f"{self.peer_id} would exceed {self.max_inbound} bytes on "
                              f"{self.protocol_id}", reason="too_large")
        gate = _SinkGate(sink)
        try:
            await self._bridge.call(receive_into, self._stream, n, gate, chunk_timeout,
                                    chunk_size)
        except asyncio.CancelledError:
            gate.close()
            raise
        self.received += n

    async def sendfile(self, path, offset: int, count: int) -> None:
        """Send `count` bytes of a local file from `offset` (see `send_file`); the name and
        arguments are those of the TCP streams' zero-copy `sendfile`, so the shard server
        takes this path for libp2p streams too."""
        await self._bridge.call(send_file, self._stream, path, offset, count)

    async def write(self, data: bytes) -> None:
        # a memoryview: yamux slices its frames out of it without copying them first
        await self._bridge.call(write_all, self._stream, memoryview(data))

    async def close(self) -> None:
        """Close our side (the peer reads EOF); never raises."""
        try:
            await self._bridge.call(close_quietly, self._stream)
        except NotRunning:
            log.debug("stream close after the host stopped")

    async def reset(self) -> None:
        """Abort the stream in both directions; never raises."""
        try:
            await self._bridge.call(reset_quietly, self._stream)
        except NotRunning:
            log.debug("stream reset after the host stopped")

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
