"""The role's view of the broadcaster (node/roles/interfaces.py `BroadcastFeed`): after a
restart it hands over the newest verified version stored on disk, its swarm settings
checked again like a downloaded manifest's."""

from __future__ import annotations

from swarm_node.node.broadcast.service import Broadcaster
from swarm_node.node.config import Config, load_config
from swarm_node.node.identity import Identity
from swarm_node.node.p2p import P2PNode
from swarm_node.node.roles.interfaces import BroadcastFeed
from swarm_node.node.roles.settings import SettingsFollower

from .conftest import make_checkpoint, node_config, wait_mesh
from .test_settings import trainer_settings


async def restarted(root, tid: str, settings: SettingsFollower) -> tuple[BroadcastFeed, list]:
    """A follower's feed over the data dir `root` of an earlier run (a fresh host, no peers)."""
    cfg = node_config()
    node = P2PNode(Identity.generate(), cfg)
    await node.start(bootstrap=[])
    feed = BroadcastFeed(Broadcaster(node, cfg.broadcast, root, follow=[tid],
                                     interactive=False, settings_check=settings.check))
    got = []
    feed.listen(got.append)
    await feed.start()
    await feed.close()
    await node.close()
    return feed, got


async def test_a_restarted_feed_hands_over_its_stored_version(tmp_path, swarm):
    ckpt = make_checkpoint(tmp_path / "ckpt", {"model.safetensors": 200_000})
    tnode, trainer = await swarm("trainer", "trainer", settings=trainer_settings())
    tid = tnode.peer_id
    _fnode, follower = await swarm("follower", "inference", follow=[tid],
                                   bootstrap=tnode.listen_addrs)
    await wait_mesh(tnode, "checkpoints", 1)
    for version in (1, 2):
        await trainer.publish(ckpt, version=version)
        await follower.done.wait(tid, version)
    await follower.close()

    # the newest stored version, once, marked stored, with its settings known exactly
    settings = SettingsFollower(Config())
    _feed, got = await restarted(tmp_path / "follower", tid, settings)
    assert [(c.policy_id, c.version, c.stored) for c in got] == [(tid, 2, True)]
    assert (got[0].path / "model.safetensors").read_bytes() == (
        ckpt / "model.safetensors").read_bytes()
    assert settings.effective_for(tid, 2).adopted["max_new_tokens"] == 2

    # settings changed since (set here, differing from the trainer's): not handed over
    settings = SettingsFollower(load_config(None, {"sampler.max_new_tokens": 5}))
    _feed, got = await restarted(tmp_path / "follower", tid, settings)
    assert got == [] and "sampler.max_new_tokens = 5 here" in settings.refused
