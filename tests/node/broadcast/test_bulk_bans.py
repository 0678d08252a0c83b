"""The bulk plane refuses peers the node refuses (NODE_SPEC 3, 7.2): its hello and each
request of an open connection ask the node's peer filter (bans, penalty cuts). Real libp2p
nodes and a real Broadcaster on loopback; the client finds the plane over libp2p."""

from __future__ import annotations

import asyncio

import pytest
from swarm_node.node.broadcast.service import Broadcaster
from swarm_node.node.broadcast.wire import FRAME_HEADER, read_frame
from swarm_node.node.identity import Identity
from swarm_node.node.p2p.bulk import BulkUnavailable
from swarm_node.protocol.messages import ShardRequest, ShardResponseHeader

from .conftest import make_checkpoint, publish
from .test_service import node_config

SHARD = 64 * 1024


@pytest.fixture
async def server_and_client(tmp_path):
    """A node serving shards on its bulk plane and a client node connected to it."""
    from swarm_node.node.p2p import P2PNode

    cfg = node_config(bulk__listen="127.0.0.1:0")
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


async def closed(conn) -> bool:
    try:
        return await asyncio.wait_for(conn.read(1), 10) == b""
    except ConnectionError:
        return True


async def test_a_banned_peer_is_refused_on_open_connections_and_at_the_hello(
        tmp_path, trainer, server_and_client):
    server, bc, client = server_and_client
    ckpt = make_checkpoint(tmp_path / "ckpt", {"model.safetensors": 3 * SHARD})
    acc = publish(trainer, ckpt, 1, SHARD)
    bc.store.add_checkpoint(acc, ckpt)
    bulk = client.bulk.client
    bulk.add_kind("shard", "shards", 4, 5.0)
    stream = await bulk.open(server.peer_id, "shard")  # endpoint asked over libp2p
    idle = await bulk.open(server.peer_id, "shard", fresh=True)
    try:
        await stream.write(request_frame(acc, 0))  # served while allowed
        header = ShardResponseHeader.decode(await read_frame(stream))
        assert header.ok and len(await stream.readexactly(header.length)) == SHARD

        server.set_peer_filter(lambda peer: peer != client.peer_id)  # banned
        # the next request on the open connection: closed, not answered
        await stream.write(request_frame(acc, 1))
        assert await closed(stream)
        # a connection opened before the ban and idle since: the same at its request
        await idle.write(request_frame(acc, 2))
        assert await closed(idle)
        # a new connection: refused at the hello, and the plane left for libp2p
        with pytest.raises(BulkUnavailable, match="refused"):
            await bulk.open(server.peer_id, "shard", fresh=True)
        assert not bulk.usable(server.peer_id, "shard")
        assert server.metrics["bulk_refused_banned"] == 3
        assert server.metrics["bulk_authenticated"] >= 2
        assert bc.server.metrics["shards_sent"] == 1
    finally:
        stream.abort()
        idle.abort()
