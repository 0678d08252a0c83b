"""Stream transports for the shard protocol: the node's (`RoutingTransport`: the bulk plane
or libp2p streams, per source), plain TCP and in-memory (tests, benchmarks of the protocol
itself). Integrity never depends on the transport: every shard is hash-checked."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable

from ...protocol.ids import SHARD_PROTOCOL
from ..lifecycle import TaskOwner
from ..p2p import BulkBusy, BulkConn, BulkError, BulkUnavailable, IdlePool, P2PError, Transport
from .errors import ShardFetchError

log = logging.getLogger(__name__)
__all__ = ["MemoryTransport", "P2PTransport", "PooledStream", "RoutingTransport",
           "TcpStream", "TcpTransport", "serve_tcp"]

Handler = Callable[[str, object], Awaitable[None]]


# TCP -------------------------------------------------------------------------------------


class TcpStream:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader, self.writer = reader, writer

    async def read(self, n: int) -> bytes:
        return await self.reader.read(n)

    async def readexactly(self, n: int) -> bytes:
        return await self.reader.readexactly(n)

    async def write(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def sendfile(self, path, offset: int, count: int) -> None:
        """Zero-copy: `sendfile(2)` from the file to the socket (asyncio falls back to
        read/send where the OS cannot)."""
        await self.writer.drain()
        with open(path, "rb") as f:  # noqa: ASYNC230 - opening a local file does not block
            await asyncio.get_running_loop().sendfile(self.writer.transport, f, offset, count)

    async def close(self) -> None:
        self.writer.close()
        try:
            await self.writer.wait_closed()
        except (ConnectionError, OSError):
            pass


class TcpTransport:
    """Peers are "host:port" strings (the peer's shard server), unauthenticated: tests and
    benchmarks of the shard protocol itself."""

    async def open(self, peer: str) -> TcpStream:
        host, _, port = peer.rpartition(":")
        return TcpStream(*await asyncio.open_connection(host, int(port), limit=1 << 20))


async def serve_tcp(handler: Handler, host: str = "127.0.0.1", port: int = 0):
    """Run `handler(peer, stream)` per connection; returns the asyncio Server. The peer is
    the remote "tcp:host:port" (unauthenticated: one connection, one peer for the limits)."""
    async def on_conn(reader, writer):
        addr = writer.get_extra_info("peername")
        await handler(f"tcp:{addr[0]}:{addr[1]}", TcpStream(reader, writer))

    return await asyncio.start_server(on_conn, host, port, limit=1 << 20)


# In-memory -------------------------------------------------------------------------------


class _Pipe:
    """One direction of an in-memory stream, with bounded buffering (backpressure)."""

    def __init__(self, max_chunks: int = 4):
        self.q: asyncio.Queue[bytes] = asyncio.Queue(max_chunks)
        self.buf = b""
        self.eof = False

    async def read(self, n: int) -> bytes:
        if not self.buf and not self.eof:
            item = await self.q.get()
            if item == b"":
                self.eof = True
            self.buf = item
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    async def readexactly(self, n: int) -> bytes:
        out = b""
        while len(out) < n:
            data = await self.read(n - len(out))
            if not data:
                raise asyncio.IncompleteReadError(out, n)
            out += data
        return out


class MemoryStream:
    def __init__(self, inbox: _Pipe, outbox: _Pipe):
        self.inbox, self.outbox = inbox, outbox
        self.closed = False

    async def read(self, n: int) -> bytes:
        return await self.inbox.read(n)

    async def readexactly(self, n: int) -> bytes:
        return await self.inbox.readexactly(n)

    async def write(self, data: bytes) -> None:
        if self.closed:
            raise ConnectionError("stream closed")
        if data:
            await self.outbox.q.put(bytes(data))

    async def close(self) -> None:
        if not self.closed:
            self.closed = True
            await self.outbox.q.put(b"")


class MemoryTransport:
    """In-process transport: `register(peer, handler)`, then `open(peer)` runs the handler
    on the other end of a fresh in-memory stream. For tests of logic without sockets."""

    def __init__(self, local_peer: str = "client"):
        self.local_peer = local_peer
        self.handlers: dict[str, Handler] = {}
        self.tasks = TaskOwner("memory transport")  # the handlers' ends

    def register(self, peer: str, handler: Handler) -> None:
        self.handlers[peer] = handler

    async def open(self, peer: str) -> MemoryStream:
        handler = self.handlers.get(peer)
        if handler is None:
            raise ConnectionError(f"no route to {peer}")
        a, b = _Pipe(), _Pipe()
        self.tasks.spawn(handler(self.local_peer, MemoryStream(b, a)), f"serve {peer}")
        return MemoryStream(a, b)


# libp2p ----------------------------------------------------------------------------------


class PooledStream:
    """A libp2p shard stream that may carry the next shard request once a response was read
    completely (`reusable()`), like the bulk plane's connections: servers keep a stream for
    another request. Profiled (libp2p only, py-spy): opening a stream per 4 MiB shard
    (yamux SYN, multistream-select round trip, window updates) was ~15% of the origin's
    py-libp2p thread. `reused` is set when the pool hands it out again: a server that ended
    it meanwhile (one request per stream, or idle past its `request_timeout_s`) shows as a
    short read at the next request, which `wire` then retries once on a fresh stream."""

    def __init__(self, inner, release: Callable[[PooledStream], None], closes: TaskOwner):
        self.inner, self.release = inner, release
        self.closes = closes  # the transport's: where a discarded stream's close runs
        self._reusable = False
        self.reused = False
        self.idle_since = 0.0
        if not hasattr(inner, "receive_into"):
            self.receive_into = None  # `wire` then reads chunk by chunk

    async def receive_into(self, n: int, sink: Callable[[bytes], None], chunk_timeout: float,
                           chunk_size: int) -> None:
        """The body in the libp2p thread, `sink` in a worker thread per chunk (see
        `AsyncStream.receive_into`): no trip through the event loop per chunk. Stream
        failures are ShardFetchError (timeout, short_read); what `sink` raises passes."""
        try:
            await self.inner.receive_into(n, sink, chunk_timeout, chunk_size)
        except P2PError as e:
            reason = "timeout" if e.reason == "timeout" else "short_read"
            raise ShardFetchError(str(e), reason=reason) from e

    async def read(self, n: int) -> bytes:
        return await self.inner.read(n)

    async def readexactly(self, n: int) -> bytes:
        return await self.inner.readexactly(n)

    async def write(self, data: bytes) -> None:
        await self.inner.write(data)

    def reusable(self) -> None:
        """The last response was read completely: the stream may carry another request."""
        self._reusable = True

    async def close(self) -> None:
        if self._reusable:
            self._reusable = False
            self.idle_since = time.monotonic()
            self.release(self)
            return
        await self.inner.close()

    def discard(self) -> None:
        """Close an idle pooled stream (from synchronous code, inside the event loop)."""
        self.closes.spawn(self.inner.close(), "close pooled stream")


class P2PTransport:
    """Shard streams over a `P2PNode` (node/p2p): peers are libp2p peer IDs."""

    def __init__(self, node: Transport):
        self.node = node

    async def open(self, peer: str):
        return await self.node.open_stream(peer, SHARD_PROTOCOL)

    def serve(self, handler: Handler) -> None:
        self.node.set_stream_handler(SHARD_PROTOCOL, handler)


# The node's transport: the bulk plane, else libp2p ----------------------------------------


class BulkShardStream:
    """A bulk-plane connection as a shard stream: its failures are ShardFetchError (timeout,
    short_read), and a TLS integrity failure (bytes changed on the path) leaves the source
    to libp2p streams for a while: never the source's fault, never charged as corrupt."""

    def __init__(self, conn: BulkConn, on_tls_error: Callable[[BulkError], None]):
        self.conn, self.on_tls_error = conn, on_tls_error
        self.reused = conn.reused

    def _failed(self, e: BulkError) -> ShardFetchError:
        if e.reason == "tls_error":
            self.on_tls_error(e)
        return ShardFetchError(str(e), reason="timeout" if e.reason == "timeout"
                               else "short_read")

    async def read(self, n: int) -> bytes:
        try:
            return await self.conn.read(n)
        except BulkError as e:
            raise self._failed(e) from e

    async def readexactly(self, n: int) -> bytes:
        try:
            return await self.conn.readexactly(n)
        except BulkError as e:
            raise self._failed(e) from e

    async def write(self, data: bytes) -> None:
        try:
            await self.conn.write(data)
        except BulkError as e:
            raise self._failed(e) from e

    async def receive_into(self, n: int, sink: Callable[[memoryview], None],
                           chunk_timeout: float, chunk_size: int) -> None:
        """The body in one worker thread (BulkConn.receive_into); what `sink` raises
        passes through."""
        try:
            await self.conn.receive_into(n, sink, chunk_timeout, chunk_size)
        except BulkError as e:
            raise self._failed(e) from e

    def reusable(self) -> None:
        self.conn.reusable()

    async def close(self) -> None:
        await self.conn.close()


class RoutingTransport:
    """Per source: its bulk plane (node/p2p/bulk: TLS, the source's peer id checked) when
    it has one we can reach and `bulk.fetch` is on, else libp2p streams; a source whose
    plane is unusable (none, unreachable, another identity at its address, refused us) is
    left to libp2p for 60 s. The source is always named by its peer ID, so throughput,
    failures and penalties go to the peer that signed the advert. One log line per source
    and path (the bulk client's)."""

    KIND = "shard"
    # Idle connections and streams kept per source for the next shard request (a server
    # closes an idle one after request_timeout_s, 10 s by default: reuse well before that)
    POOL_PER_PEER = 4
    POOL_IDLE_S = 5.0

    def __init__(self, p2p, bulk=None):
        self.p2p = p2p
        self.bulk = bulk.client if bulk is not None else None
        if self.bulk is not None:
            self.bulk.add_kind(self.KIND, "shards", self.POOL_PER_PEER, self.POOL_IDLE_S)
        self.opened = Counter({"bulk": 0, "bulk_reused": 0, "libp2p": 0, "libp2p_reused": 0})
        # libp2p shard streams: no liveness peek; kept for less than POOL_IDLE_S, half the
        # servers' default idle bound, and a dead one is retried (wire._open_request)
        self.idle_p2p: IdlePool[PooledStream] = IdlePool(self.POOL_PER_PEER, self.POOL_IDLE_S)
        self.tasks = TaskOwner("shard streams")  # closes of discarded pooled streams

    def set_endpoint(self, peer: str, endpoint: str) -> None:
        """The bulk endpoint a source advertised (signed)."""
        if self.bulk is not None:
            self.bulk.set_endpoint(peer, endpoint)

    def forget_idle(self, peer: str) -> None:
        """A pooled stream to `peer` was found dead: the other idle ones likely are too."""
        self.idle_p2p.drop(peer)
        if self.bulk is not None:
            self.bulk.forget_idle(peer, self.KIND)

    def close(self) -> None:
        """Close every idle connection and pooled stream."""
        self.idle_p2p.drop_all()
        if self.bulk is not None:
            self.bulk.kinds[self.KIND].pool.drop_all()

    async def open(self, peer: str, fresh: bool = False):
        """A stream to `peer`'s shard server: a pooled idle one, or (`fresh`, or none idle)
        a new one."""
        bulk = self.bulk
        if bulk is not None and bulk.usable(peer, self.KIND):
            try:
                conn = await bulk.open(peer, self.KIND, fresh=fresh)
            except BulkBusy:
                self.opened["bulk_busy"] += 1  # this request over libp2p, nothing marked
            except BulkUnavailable:
                pass  # marked down and said by the client
            else:
                self.opened["bulk_reused" if conn.reused else "bulk"] += 1
                return BulkShardStream(conn, lambda e: bulk.mark_down(
                    peer, self.KIND, f"TLS integrity failure: {e}"))
        elif bulk is not None:
            bulk.say(peer, self.KIND, "libp2p streams", "bulk plane down for 60 s"
                     if bulk.cfg.fetch else "bulk.fetch is off")
        stream = None if fresh else self.idle_p2p.take(peer)
        if stream is not None:
            stream.reused = True
            self.opened["libp2p_reused"] += 1
            return stream
        self.opened["libp2p"] += 1
        return PooledStream(await self.p2p.open(peer), lambda s: self.idle_p2p.put(peer, s),
                            self.tasks)
