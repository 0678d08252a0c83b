"""Broadcaster over real libp2p hosts on loopback (in one process): trainer -> relay ->
follower, gossip manifests and adverts, shards over SHARD_PROTOCOL."""

from __future__ import annotations

import asyncio

import pytest
from swarm_node.node.broadcast.service import Broadcaster
from swarm_node.node.config import Config
from swarm_node.node.identity import Identity

from .conftest import make_checkpoint, read_dir


def node_config() -> Config:
    cfg = Config()
    cfg.node.listen = ["/ip4/127.0.0.1/tcp/0"]
    cfg.p2p.discovery_interval_s = 0.5
    cfg.p2p.bootstrap_timeout_s = 5
    cfg.p2p.dial_timeout_s = 3
    cfg.p2p.mesh_wait_s = 3
    cfg.broadcast.shard_size = 64 * 1024
    cfg.broadcast.min_shard_size = 4096
    cfg.broadcast.chunk_size = 32 * 1024
    cfg.broadcast.advert_interval_s = 0.1
    cfg.broadcast.readvertise_s = 0.5
    return cfg


@pytest.fixture
async def swarm(tmp_path):
    from swarm_node.node.p2p import P2PNode

    made = []

    async def make(name, role, follow=(), bootstrap=(), identity=None, bulk=False,
                   libp2p_only=False, **kw):
        cfg = node_config()
        if bulk:
            cfg.bulk.listen = "127.0.0.1:0"
        if libp2p_only:
            cfg.bulk.listen = "off"
        node = P2PNode(identity or Identity.generate(), cfg)
        await node.start(bootstrap=list(bootstrap))
        bc = Broadcaster(node, cfg.broadcast, tmp_path / name, follow=list(follow), role=role,
                         interactive=False, **kw)
        await bc.start()
        made.append((node, bc))
        return node, bc

    yield make
    for node, bc in reversed(made):
        await bc.close()
        await node.close()


async def test_trainer_relay_follower(tmp_path, swarm):
    ckpt = make_checkpoint(tmp_path / "ckpt", {"model.safetensors": 700_000, "config.json": 900})
    tnode, trainer = await swarm("trainer", "trainer")
    tid = tnode.peer_id
    rnode, relay = await swarm("relay", "relay", follow=[tid], bootstrap=tnode.listen_addrs)
    got = []
    _fnode, follower = await swarm("follower", "inference", follow=[tid],
                                  bootstrap=rnode.listen_addrs,
                                  on_complete=lambda m, p: got.append((m.version, p)))
    await asyncio.sleep(1.5)  # let the gossip mesh form
    m = await trainer.publish(ckpt, version=1)
    path = await follower.wait_complete(tid, 1, timeout=60)
    assert read_dir(path) == read_dir(ckpt)
    assert got == [(1, path)]
    rpath = await relay.wait_complete(tid, 1, timeout=60)
    assert read_dir(rpath) == read_dir(ckpt)
    assert follower.finished[(tid, 1)].metrics["bytes_fetched"] == m.total_size
    # a forged manifest (another key claiming to be a trainer) is rejected, not fetched
    forger = Identity.generate()
    from swarm_node.node.broadcast.errors import ManifestRejected
    from swarm_node.node.broadcast.manifest import build_manifest

    fake = build_manifest(ckpt, policy_id=forger.peer_id, version=2, shard_size=65536)
    with pytest.raises(ManifestRejected) as e:
        follower.accept_bytes(forger.seal(fake))
    assert e.value.reason == "not_followed"


async def test_an_older_nodes_whole_file_manifest_still_downloads(tmp_path, swarm):
    """`broadcast.hash_algo = "blake3"` (a swarm with followers from before the shard-list
    hash): the follower hashes the whole checkpoint in order beside the shards and checks
    it (test_store: a wrong one fails the version)."""
    ckpt = make_checkpoint(tmp_path / "ckpt", {"model.safetensors": 700_000, "config.json": 900})
    tnode, trainer = await swarm("trainer", "trainer")
    trainer.cfg.hash_algo = "blake3"
    m = await trainer.publish(ckpt, version=1)
    assert m.hash_algo == "blake3" and m.checkpoint_hash != m.shard_list_hash()
    _fnode, follower = await swarm("follower", "inference", follow=[tnode.peer_id],
                                   bootstrap=tnode.listen_addrs)
    path = await follower.wait_complete(tnode.peer_id, 1, timeout=60)
    assert read_dir(path) == read_dir(ckpt)
    metrics = follower.finished[(tnode.peer_id, 1)].metrics
    assert metrics["whole_hash_live_bytes"] + metrics["whole_hash_read_back_bytes"] \
        == m.total_size and metrics["whole_hash_redone"] == 0
    # the default: no whole-file pass at all
    trainer.cfg.hash_algo = "blake3-shard-list"
    m2 = await trainer.publish(ckpt, version=2)
    await follower.wait_complete(tnode.peer_id, 2, timeout=60)
    assert m2.checkpoint_hash == m2.shard_list_hash()
    assert "whole_hash_live_bytes" not in follower.finished[(tnode.peer_id, 2)].metrics


async def test_late_joiner_learns_version_from_adverts_and_uses_the_bulk_plane(tmp_path,
                                                                               swarm):
    ckpt = make_checkpoint(tmp_path / "ckpt", {"model.safetensors": 500_000})
    tnode, trainer = await swarm("trainer", "trainer", bulk=True)
    assert trainer.endpoint.startswith("127.0.0.1:")
    m = await trainer.publish(ckpt, version=1)  # nobody listening yet
    _fnode, late = await swarm("late", "inference", follow=[tnode.peer_id],
                              bootstrap=tnode.listen_addrs, bulk=True)
    path = await late.wait_complete(tnode.peer_id, 1, timeout=60)
    assert read_dir(path) == read_dir(ckpt)
    host, _, port = trainer.endpoint.rpartition(":")
    assert late.transport.bulk.endpoints[tnode.peer_id] == (host, int(port))
    assert late.transport.opened["bulk"] > 0
    assert late.finished[(tnode.peer_id, 1)].metrics["bytes_fetched"] == m.total_size
    # the late joiner now serves it too, on its bulk plane, advertised under its peer ID
    assert late.endpoint and late.store.current_version(tnode.peer_id) == 1


async def test_libp2p_shard_streams_carry_several_requests(tmp_path, swarm):
    """Without the data plane, shards come over libp2p streams that carry request after
    request (not a stream per shard), and every upload ends cleanly."""
    ckpt = make_checkpoint(tmp_path / "ckpt", {"model.safetensors": 1_500_000})
    tnode, trainer = await swarm("trainer", "trainer", libp2p_only=True)
    m = await trainer.publish(ckpt, version=1)
    _fnode, late = await swarm("late", "inference", follow=[tnode.peer_id],
                              bootstrap=tnode.listen_addrs, libp2p_only=True)
    path = await late.wait_complete(tnode.peer_id, 1, timeout=60)
    assert read_dir(path) == read_dir(ckpt)
    opened = late.transport.opened
    assert opened["bulk"] == 0 and opened["libp2p_reused"] > 0
    assert opened["libp2p"] <= late.cfg.parallel_downloads < m.num_shards
    assert opened["libp2p"] + opened["libp2p_reused"] >= m.num_shards
    assert trainer.server.metrics["shards_sent"] == m.num_shards
    assert trainer.server.metrics["aborted"] == 0
