"""Broadcaster over real libp2p hosts on loopback (in one process): trainer -> relay ->
follower, gossip manifests and adverts, shards over SHARD_PROTOCOL."""

from __future__ import annotations

import pytest
from swarm_node.node.identity import Identity

from .conftest import make_checkpoint, node_config, read_dir, wait_mesh

__all__ = ["node_config"]  # test_bulk_bans takes it from here


async def test_trainer_relay_follower(tmp_path, swarm):
    ckpt = make_checkpoint(tmp_path / "ckpt", {"model.safetensors": 700_000, "config.json": 900})
    tnode, trainer = await swarm("trainer", "trainer")
    tid = tnode.peer_id
    rnode, relay = await swarm("relay", "relay", follow=[tid], bootstrap=tnode.listen_addrs)
    _fnode, follower = await swarm("follower", "inference", follow=[tid],
                                   bootstrap=rnode.listen_addrs)
    await wait_mesh(rnode, "checkpoints", 2)  # the trainer and the follower
    m = await trainer.publish(ckpt, version=1)
    done = await follower.done.wait(tid, 1)
    assert read_dir(done.path) == read_dir(ckpt)
    assert list(follower.done.got) == [(tid, 1)]
    rdone = await relay.done.wait(tid, 1)
    assert read_dir(rdone.path) == read_dir(ckpt)
    assert done.metrics["bytes_fetched"] == done.fetched == m.total_size
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
    m = await trainer.publish(ckpt, version=1, hash_algo="blake3")
    assert m.hash_algo == "blake3" and m.checkpoint_hash != m.shard_list_hash()
    _fnode, follower = await swarm("follower", "inference", follow=[tnode.peer_id],
                                   bootstrap=tnode.listen_addrs)
    done = await follower.done.wait(tnode.peer_id, 1)
    assert read_dir(done.path) == read_dir(ckpt)
    metrics = done.metrics
    assert metrics["whole_hash_live_bytes"] + metrics["whole_hash_read_back_bytes"] \
        == m.total_size and metrics["whole_hash_redone"] == 0
    # the default: no whole-file pass at all
    m2 = await trainer.publish(ckpt, version=2)
    done2 = await follower.done.wait(tnode.peer_id, 2)
    assert m2.checkpoint_hash == m2.shard_list_hash()
    assert "whole_hash_live_bytes" not in done2.metrics


async def test_late_joiner_learns_version_from_adverts_and_uses_the_bulk_plane(tmp_path,
                                                                               swarm):
    ckpt = make_checkpoint(tmp_path / "ckpt", {"model.safetensors": 500_000})
    tnode, trainer = await swarm("trainer", "trainer", bulk=True)
    assert trainer.endpoint.startswith("127.0.0.1:")
    m = await trainer.publish(ckpt, version=1)  # nobody listening yet
    _fnode, late = await swarm("late", "inference", follow=[tnode.peer_id],
                              bootstrap=tnode.listen_addrs, bulk=True)
    done = await late.done.wait(tnode.peer_id, 1)
    assert read_dir(done.path) == read_dir(ckpt)
    host, _, port = trainer.endpoint.rpartition(":")
    assert late.transport.bulk.endpoints[tnode.peer_id] == (host, int(port))
    assert late.transport.opened["bulk"] > 0
    assert done.metrics["bytes_fetched"] == m.total_size
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
    done = await late.done.wait(tnode.peer_id, 1)
    assert read_dir(done.path) == read_dir(ckpt)
    opened = late.transport.opened
    assert opened["bulk"] == 0 and opened["libp2p_reused"] > 0
    assert opened["libp2p"] <= late.cfg.parallel_downloads < m.num_shards
    assert opened["libp2p"] + opened["libp2p_reused"] >= m.num_shards
    assert trainer.server.metrics["shards_sent"] == m.num_shards
    assert trainer.server.metrics["aborted"] == 0
