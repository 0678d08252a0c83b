"""The data plane's receiving side (DirectTcpStream: one thread per shard body) against a
real TCP server that misbehaves, and the one-token-request-per-peer rule."""

from __future__ import annotations

import asyncio

import pytest
from swarm_node.node.broadcast.dataplane import RoutingTransport, TokenIssuer
from swarm_node.node.broadcast.errors import ShardFetchError
from swarm_node.node.broadcast.transport import TcpTransport
from swarm_node.node.broadcast.wire import FRAME_HEADER, fetch_into
from swarm_node.protocol.messages import ShardRequest, ShardResponseHeader

BODY = 256 * 1024
REQ = ShardRequest(policy_id="P", version=1, shard=0)


async def bad_server(behaviour: str, release: asyncio.Event):
    """Answers any request with a header for BODY bytes, sends half, then: "stall" (keeps the
    connection open until `release`) or "close". Returns (server, endpoint)."""
    async def on_conn(reader, writer):
        (n,) = FRAME_HEADER.unpack(await reader.readexactly(FRAME_HEADER.size))
        await reader.readexactly(n)
        header = ShardResponseHeader(ok=True, length=BODY).encode()
        writer.write(FRAME_HEADER.pack(len(header)) + header + b"\x07" * (BODY // 2))
        await writer.drain()
        if behaviour == "stall":
            await release.wait()
        writer.close()

    server = await asyncio.start_server(on_conn, "127.0.0.1", 0)
    return server, f"127.0.0.1:{server.sockets[0].getsockname()[1]}"


class Sink:
    def __init__(self):
        self.got = 0

    def __call__(self, view) -> None:  # runs in the receiving thread
        self.got += len(view)


@pytest.mark.parametrize("behaviour, reason", [("stall", "timeout"), ("close", "short_read")])
async def test_a_broken_body_is_a_fetch_error_with_the_bytes_so_far(behaviour, reason):
    release = asyncio.Event()
    server, endpoint = await bad_server(behaviour, release)
    sink = Sink()
    try:
        with pytest.raises(ShardFetchError) as e:
            await fetch_into(TcpTransport(), endpoint, REQ, sink, expected_len=BODY,
                             request_timeout=5, chunk_timeout=0.5, chunk_size=64 * 1024)
        assert e.value.reason == reason
        assert sink.got == BODY // 2
    finally:
        release.set()
        server.close()


async def test_cancelling_a_transfer_ends_its_thread_and_closes_the_socket():
    release = asyncio.Event()
    server, endpoint = await bad_server("stall", release)
    stream = await TcpTransport().open(endpoint)
    try:
        await stream.write(FRAME_HEADER.pack(len(REQ.encode())) + REQ.encode())
        (n,) = FRAME_HEADER.unpack(await stream.readexactly(FRAME_HEADER.size))
        await stream.readexactly(n)
        task = asyncio.create_task(stream.receive_into(BODY, Sink(), 60.0, 64 * 1024))
        while stream._body is None:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await stream.close()
        # the receiving thread ends long before its 60 s chunk timeout, then the socket closes
        async with asyncio.timeout(10):
            while stream.sock.fileno() != -1:
                await asyncio.sleep(0.01)
        assert stream._body.done()
    finally:
        release.set()
        server.close()


class CountingNode:
    """Stands in for the libp2p node's request (the token exchange is what is counted)."""

    def __init__(self):
        self.peer_id = "client"
        self.issuer = TokenIssuer("server", ttl_s=60)
        self.requests = 0

    async def request(self, peer, protocol, body, timeout, max_response):
        self.requests += 1
        await asyncio.sleep(0.05)  # the answer takes a round trip
        return self.issuer.issue(self.peer_id)


class FakeP2P:
    def __init__(self):
        self.node = CountingNode()


async def test_transfers_starting_together_share_one_token_request():
    t = RoutingTransport(FakeP2P())
    tokens = await asyncio.gather(*(t._token("server") for _ in range(8)))
    assert len(set(tokens)) == 1 and t.p2p.node.requests == 1
    await t._token("server")  # cached
    assert t.p2p.node.requests == 1
