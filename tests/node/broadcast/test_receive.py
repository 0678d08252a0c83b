"""The receiving side of a shard body against a real server that misbehaves, over plain TCP
(the protocol itself) and over the bulk plane (TLS; one receiving thread per body), and the
one-endpoint-query-per-peer rule of the bulk client."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from swarm_node.node.broadcast.errors import ShardFetchError
from swarm_node.node.broadcast.transport import RoutingTransport, TcpTransport
from swarm_node.node.broadcast.wire import FRAME_HEADER, fetch_into
from swarm_node.node.config import BulkSection
from swarm_node.node.identity import Identity
from swarm_node.node.p2p.bulk import BulkClient, BulkServer
from swarm_node.node.p2p.bulk.cert import server_context
from swarm_node.node.p2p.metrics import P2PMetrics
from swarm_node.protocol.messages import ShardRequest, ShardResponseHeader

from tests.waiting import async_wait_until

BODY = 256 * 1024
REQ = ShardRequest(policy_id="P", version=1, shard=0)
SERVER, ME = Identity.generate(), Identity.generate()


async def answer_half(stream, behaviour: str, release: asyncio.Event) -> None:
    """Answer a request with a header for BODY bytes, send half, then "stall" (until
    `release`) or "close"."""
    (n,) = FRAME_HEADER.unpack(await stream.readexactly(FRAME_HEADER.size))
    await stream.readexactly(n)
    header = ShardResponseHeader(ok=True, length=BODY).encode()
    await stream.write(FRAME_HEADER.pack(len(header)) + header + b"\x07" * (BODY // 2))
    if behaviour == "stall":
        await release.wait()


async def bad_server(path: str, behaviour: str, release: asyncio.Event):
    """(transport, peer, close) of a server that answers as `answer_half` does."""
    if path == "tcp":
        async def on_conn(reader, writer):
            from swarm_node.node.broadcast.transport import TcpStream
            await answer_half(TcpStream(reader, writer), behaviour, release)
            writer.close()

        server = await asyncio.start_server(on_conn, "127.0.0.1", 0)
        endpoint = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
        return TcpTransport(), endpoint, server.close
    plane = BulkServer(SERVER.peer_id, server_context(SERVER), BulkSection(), P2PMetrics())
    plane.register("shard", lambda peer, conn: answer_half(conn, behaviour, release))
    _, port = await plane.start("127.0.0.1", 0)
    rt = RoutingTransport(None, bulk=SimpleNamespace(
        client=BulkClient(ME, BulkSection(), query=None)))
    rt.set_endpoint(SERVER.peer_id, f"127.0.0.1:{port}")
    return rt, SERVER.peer_id, plane.close


class Sink:
    def __init__(self):
        self.got = 0

    def __call__(self, view) -> None:  # runs in the receiving thread
        self.got += len(view)


@pytest.mark.parametrize("path", ["tcp", "bulk"])
@pytest.mark.parametrize("behaviour, reason", [("stall", "timeout"), ("close", "short_read")])
async def test_a_broken_body_is_a_fetch_error_with_the_bytes_so_far(path, behaviour, reason):
    release = asyncio.Event()
    transport, peer, close = await bad_server(path, behaviour, release)
    sink = Sink()
    try:
        with pytest.raises(ShardFetchError) as e:
            await fetch_into(transport, peer, REQ, sink, expected_len=BODY,
                             request_timeout=5, chunk_timeout=0.5, chunk_size=64 * 1024)
        assert e.value.reason == reason
        assert sink.got == BODY // 2
    finally:
        release.set()
        result = close()
        if asyncio.iscoroutine(result):
            await result


async def test_cancelling_a_transfer_ends_its_thread_and_closes_the_socket():
    release = asyncio.Event()
    rt, peer, close = await bad_server("bulk", "stall", release)
    stream = await rt.open(peer)
    conn = stream.conn
    try:
        await stream.write(FRAME_HEADER.pack(len(REQ.encode())) + REQ.encode())
        (n,) = FRAME_HEADER.unpack(await stream.readexactly(FRAME_HEADER.size))
        await stream.readexactly(n)
        task = asyncio.create_task(stream.receive_into(BODY, Sink(), 60.0, 64 * 1024))
        await async_wait_until(lambda: conn._op is not None, 10, "the receiving thread to start")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await stream.close()
        # the receiving thread ends long before its 60 s chunk timeout, then the socket closes
        # (the close is a callback of the thread's end, run before this wait wakes)
        ended, _ = await asyncio.wait([conn._op], timeout=10)
        assert ended and conn.sock.fileno() == -1
    finally:
        release.set()
        await close()


async def test_transfers_starting_together_share_one_endpoint_query():
    plane = BulkServer(SERVER.peer_id, server_context(SERVER), BulkSection(), P2PMetrics())
    plane.register("shard", lambda peer, conn: conn.read(1))
    _, port = await plane.start("127.0.0.1", 0)
    asked, queried, answer = [], asyncio.Event(), asyncio.Event()

    async def query(peer):
        asked.append(peer)
        queried.set()
        await answer.wait()  # the answer takes a round trip: the other transfers start
        return "127.0.0.1", port

    client = BulkClient(ME, BulkSection(), query)
    client.add_kind("shard", "shards", 8, 5.0)
    conns = []
    try:
        opening = asyncio.gather(*(client.open(SERVER.peer_id, "shard") for _ in range(4)))
        await asyncio.wait_for(queried.wait(), 10)
        answer.set()
        conns = await opening
        assert len({id(c) for c in conns}) == 4 and asked == [SERVER.peer_id]
        conns.append(await client.open(SERVER.peer_id, "shard", fresh=True))  # cached
        assert asked == [SERVER.peer_id]
    finally:
        for c in conns:
            c.abort()
        client.close()
        await plane.close()
