"""The data plane refuses peers the node refuses (NODE_SPEC 7.2): a data-plane token outlives
a ban, so the hello and each request of an open connection ask the node's peer filter.
Real libp2p nodes and a real Broadcaster on loopback."""

from __future__ import annotations

import asyncio

import pytest
from swarm_node.node.broadcast.dataplane import SHARD_TOKEN_PROTOCOL, hello_frame
from swarm_node.node.broadcast.service import Broadcaster
from swarm_node.node.broadcast.transport import TcpStream
from swarm_node.node.broadcast.wire import FRAME_HEADER, read_frame
from swarm_node.node.identity import Identity
from swarm_node.node.p2p.tokens import CHALLENGE_LEN
from swarm_node.protocol.messages import ShardRequest, ShardResponseHeader

from .conftest import make_checkpoint, publish
from .test_service import node_config

SHARD = 64 * 1024


@pytest.fixture
async def server_and_client(tmp_path):
    """A node serving shards on its data plane (tcp) and a client node connected to it."""
    from swarm_node.node.p2p import P2PNode

    cfg = node_config()
    cfg.broadcast.tcp_listen = "127.0.0.1:0"
    server = P2PNode(Identity.generate(), cfg)
    await server.start(bootstrap=[])
    client = P2PNode(Identity.generate(), node_config())
    bc = None
    try:
        await client.start(bootstrap=server.listen_addrs)
        bc = Broadcaster(server, cfg.broadcast, tmp_path / "server", role="relay",
                         interactive=False)
        await bc.start()
        yield server, bc, client
    finally:
        if bc is not None:
            await bc.close()
        await client.close()
        await server.close()


def request_frame(acc, shard: int) -> bytes:
    raw = ShardRequest(policy_id=acc.manifest.policy_id, version=acc.manifest.version,
                       shard=shard).encode()
    return FRAME_HEADER.pack(len(raw)) + raw


async def hello(endpoint: str, client, token: bytes) -> tuple[TcpStream, bytes]:
    """A data-plane connection after the hello, and the server's first byte (b"" if closed)."""
    host, _, port = endpoint.rpartition(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    stream = TcpStream(reader, writer)
    challenge = await asyncio.wait_for(stream.readexactly(CHALLENGE_LEN), 10)
    await stream.write(hello_frame(client.peer_id, token, challenge))
    return stream, await answer(stream, 1)


async def answer(stream: TcpStream, n: int) -> bytes:
    try:
        return await asyncio.wait_for(stream.reader.read(n), 10)
    except ConnectionResetError:
        return b""


async def test_a_banned_peer_with_a_valid_token_is_refused(tmp_path, trainer,
                                                           server_and_client):
    server, bc, client = server_and_client
    ckpt = make_checkpoint(tmp_path / "ckpt", {"model.safetensors": 3 * SHARD})
    acc = publish(trainer, ckpt, 1, SHARD)
    bc.store.add_checkpoint(acc, ckpt)
    token = await client.request(server.peer_id, SHARD_TOKEN_PROTOCOL, b"", timeout=10,
                                 max_response=128)
    stream, ack = await hello(bc.endpoint, client, token)
    idle, ack_idle = await hello(bc.endpoint, client, token)
    try:
        assert ack == ack_idle == b"\x01"
        await stream.write(request_frame(acc, 0))  # served while allowed
        header = ShardResponseHeader.decode(await read_frame(stream))
        assert header.ok and len(await stream.readexactly(header.length)) == SHARD

        server.set_peer_filter(lambda peer: peer != client.peer_id)  # banned
        # the next request on the open connection: closed, not answered
        await stream.write(request_frame(acc, 1))
        assert await answer(stream, 1) == b""
        # a connection opened before the ban and idle since: the same at its request
        await idle.write(request_frame(acc, 2))
        assert await answer(idle, 1) == b""
        # a new connection with the still valid token: refused at the hello
        again, ack_again = await hello(bc.endpoint, client, token)
        await again.close()
        assert ack_again == b""
        plane = bc._tcp_server
        assert plane.metrics["refused_banned"] == 3
        assert plane.metrics["authenticated"] == 2
        assert bc.server.metrics["shards_sent"] == 1
    finally:
        await stream.close()
        await idle.close()
