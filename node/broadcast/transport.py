"""Stream transports for the shard protocol: libp2p (the node), TCP and in-memory (tests,
benchmarks). Integrity never depends on the transport: every shard is hash-checked."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from ...protocol.ids import SHARD_PROTOCOL

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
    """Peers are "host:port" strings (the peer's shard server)."""

    async def open(self, peer: str) -> TcpStream:
        host, _, port = peer.rpartition(":")
        reader, writer = await asyncio.open_connection(host, int(port), limit=1 << 20)
        return TcpStream(reader, writer)


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


class P2PTransport:
    """Shard streams over a `P2PNode` (node/p2p): peers are libp2p peer IDs."""

    def __init__(self, node):
        self.node = node

    async def open(self, peer: str):
        return await self.node.open_stream(peer, SHARD_PROTOCOL)

    def serve(self, handler: Handler) -> None:
        self.node.set_stream_handler(SHARD_PROTOCOL, handler)
