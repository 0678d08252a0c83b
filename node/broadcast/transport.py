"""Stream transports for the shard protocol: libp2p (the node), TCP and in-memory (tests,
benchmarks). Integrity never depends on the transport: every shard is hash-checked."""

from __future__ import annotations

import asyncio
import ctypes
import socket
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor

from ...protocol.ids import SHARD_PROTOCOL
from ..p2p.errors import P2PError
from .errors import ShardFetchError

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


# Shard bodies leave the event loop: one blocking thread per transfer receives, hashes and
# writes (GIL released in recv_into, BLAKE3 and pwrite), so the loop keeps serving.
def _name_native_thread(name: bytes = b"shard-rx") -> None:
    """Give the OS thread a name (top -H, perf and /proc show it; Python 3.11 does not)."""
    try:
        ctypes.CDLL(None).prctl(15, name)  # PR_SET_NAME; Linux only, harmless elsewhere
    except (OSError, AttributeError):
        pass


_RX_POOL = ThreadPoolExecutor(max_workers=32, thread_name_prefix="shard-rx",
                              initializer=_name_native_thread)
# Per process: recv calls and body bytes of the receiving threads (benchmark notes: bytes
# per call tells small reads under contention from a costly kernel copy; measured at 8
# clients: ~780 KiB per call, so the receivers' kernel time is not syscall count).
RX_STATS: Counter[str] = Counter()
_RX_STATS_LOCK = threading.Lock()


class DirectTcpStream:
    """A client-side TCP stream on a raw socket: control frames through the event loop
    (`sock_recv_into` reads exactly what is asked, so nothing of the body is buffered
    here), and the body through `receive_into`, one thread per transfer: `recv_into` a
    reused buffer, then `sink(view)` (hash + pwrite), no per-chunk hop to the loop and no
    copies beyond the kernel's (profiled: StreamReader buffering and a thread hop per chunk
    were most of a client's CPU on the data plane)."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.loop = asyncio.get_running_loop()
        self._body: asyncio.Future | None = None
        self._closed = False
        # set by a pool (RoutingTransport): after `reusable()`, close() hands the
        # connection back for the next request instead of closing it
        self.release: Callable[[DirectTcpStream], None] | None = None
        self._reusable = False
        self.idle_since = 0.0

    def reusable(self) -> None:
        """The last response was read completely: the connection may carry another."""
        self._reusable = self.release is not None

    def alive(self) -> bool:
        """Still open with nothing unread (a peek without blocking): a server that closed
        an idle connection, or one that serves one request per connection, reads as dead."""
        try:
            self.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:
            return True
        except OSError:
            return False
        return False  # end of stream, or bytes nobody asked for

    @classmethod
    async def connect(cls, host: str, port: int) -> DirectTcpStream:
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        family, kind, proto, _, addr = infos[0]
        sock = socket.socket(family, kind, proto)
        sock.setblocking(False)
        try:
            await loop.sock_connect(sock, addr)
        except BaseException:
            sock.close()
            raise
        return cls(sock)

    async def read(self, n: int) -> bytes:
        return await self.loop.sock_recv(self.sock, n)

    async def readexactly(self, n: int) -> bytes:
        buf = bytearray(n)
        view, got = memoryview(buf), 0
        while got < n:
            k = await self.loop.sock_recv_into(self.sock, view[got:])
            if not k:
                raise asyncio.IncompleteReadError(bytes(buf[:got]), n)
            got += k
        return bytes(buf)

    async def write(self, data: bytes) -> None:
        await self.loop.sock_sendall(self.sock, data)

    async def receive_into(self, n: int, sink: Callable[[memoryview], None],
                           chunk_timeout: float, chunk_size: int) -> None:
        """Receive exactly `n` body bytes into `sink` (blocking; called in the receiving
        thread). A network failure raises ShardFetchError (timeout: nothing arrived for
        `chunk_timeout`; short_read); what `sink` raises passes through. If the caller is
        cancelled the socket is shut down, which ends the thread's transfer at once."""
        self._body = self.loop.run_in_executor(_RX_POOL, self._receive, n, sink,
                                               chunk_timeout, chunk_size)
        try:
            await asyncio.shield(self._body)
        except asyncio.CancelledError:
            self._shutdown()
            # the thread ends with a short read nobody awaits: not an error to log
            self._body.add_done_callback(lambda f: f.cancelled() or f.exception())
            raise

    def _receive(self, n: int, sink, chunk_timeout: float, chunk_size: int) -> None:
        self.sock.settimeout(chunk_timeout)
        view = memoryview(bytearray(min(chunk_size, n)))
        left, calls = n, 0
        while left > 0:
            calls += 1
            try:
                k = self.sock.recv_into(view, min(len(view), left))
            except TimeoutError as e:
                raise ShardFetchError(f"stalled with {left} bytes left", reason="timeout") from e
            except OSError as e:
                raise ShardFetchError(f"{e!r} with {left} bytes left", reason="short_read") from e
            if not k:
                raise ShardFetchError(f"stream ended with {left} bytes left",
                                      reason="short_read")
            sink(view[:k])
            left -= k
        with _RX_STATS_LOCK:
            RX_STATS["calls"] += calls
            RX_STATS["bytes"] += n

    def discard(self) -> None:
        """Close an idle connection (no transfer running) at once."""
        self._closed = True
        self.sock.close()

    def _shutdown(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    async def close(self) -> None:
        if self._closed:
            return
        if self._reusable and self._body is not None and self._body.done() \
                and self._body.exception() is None:
            self._reusable = False
            self._body = None
            self.sock.setblocking(False)  # the receiving thread set a timeout
            self.idle_since = time.monotonic()
            self.release(self)
            return
        self._closed = True
        body = self._body
        if body is not None and not body.done():
            # the receiving thread still uses the socket: end it first, close after
            self._shutdown()
            body.add_done_callback(lambda _: self.sock.close())
            return
        self.sock.close()


class TcpTransport:
    """Peers are "host:port" strings (the peer's shard server), unauthenticated: tests and
    benchmarks of the shard protocol itself."""

    async def open(self, peer: str) -> DirectTcpStream:
        host, _, port = peer.rpartition(":")
        return await DirectTcpStream.connect(host, int(port))


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
        self.tasks: set[asyncio.Task] = set()

    def register(self, peer: str, handler: Handler) -> None:
        self.handlers[peer] = handler

    async def open(self, peer: str) -> MemoryStream:
        handler = self.handlers.get(peer)
        if handler is None:
            raise ConnectionError(f"no route to {peer}")
        a, b = _Pipe(), _Pipe()
        task = asyncio.create_task(handler(self.local_peer, MemoryStream(b, a)))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return MemoryStream(a, b)


# libp2p ----------------------------------------------------------------------------------


_CLOSING: set[asyncio.Task] = set()  # closes of discarded pooled streams, kept referenced


class PooledStream:
    """A libp2p shard stream that may carry the next shard request once a response was read
    completely (`reusable()`), like the data plane's connections: servers keep a stream for
    another request. Profiled (libp2p only, py-spy): opening a stream per 4 MiB shard
    (yamux SYN, multistream-select round trip, window updates) was ~15% of the origin's
    py-libp2p thread. `reused` is set when the pool hands it out again: a server that ended
    it meanwhile (one request per stream, or idle past its `request_timeout_s`) shows as a
    short read at the next request, which `wire` then retries once on a fresh stream."""

    def __init__(self, inner, release: Callable[[PooledStream], None]):
        self.inner, self.release = inner, release
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
        task = asyncio.get_running_loop().create_task(self.inner.close())
        _CLOSING.add(task)
        task.add_done_callback(_CLOSING.discard)


class P2PTransport:
    """Shard streams over a `P2PNode` (node/p2p): peers are libp2p peer IDs."""

    def __init__(self, node):
        self.node = node

    async def open(self, peer: str):
        return await self.node.open_stream(peer, SHARD_PROTOCOL)

    def serve(self, handler: Handler) -> None:
        self.node.set_stream_handler(SHARD_PROTOCOL, handler)
