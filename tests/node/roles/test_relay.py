"""The relay role and the download tracker (node/roles/base.py) against a fake checkpoint
feed. The real broadcaster behind them is proven by tests/integration/test_swarm.py."""

from __future__ import annotations

import logging

from swarm_node.node.config import Config
from swarm_node.node.identity import Identity
from swarm_node.node.metrics import NodeState
from swarm_node.node.roles.base import DownloadTracker
from swarm_node.node.roles.interfaces import DownloadStatus
from swarm_node.node.roles.relay import RelayRole

from tests.waiting import async_wait_until

from .fakes import FakeFeed, FakeP2P

TRAINER = "12D3KooWtrainerFollowed"


async def test_relay_mirrors_what_the_feed_yields(tmp_path):
    cfg = Config.model_validate({"node": {"data_dir": str(tmp_path), "role": "relay",
                                          "follow": [TRAINER]}})
    ident = Identity.generate()
    feed = FakeFeed(tmp_path, follow=[TRAINER])
    role = RelayRole(cfg, ident, FakeP2P(), NodeState(ident.peer_id, "relay", "s"), feed=feed)
    await role.start()
    try:
        assert feed.started and role.state.extra["disk"]["paused"] is False
        for version in (1, 2):
            feed.deliver(TRAINER, version, tmp_path / f"v{version}", size=1000)
    finally:
        await role.close()
    assert role.state.policy_id == TRAINER and role.state.policy_version == 2
    assert role.state.counters["versions_mirrored"] == 2 and feed.closed


def test_download_tracker_shows_progress_then_records_each_handed_over_download(tmp_path):
    state, feed = NodeState("12D3KooWme", "relay", "s"), FakeFeed(tmp_path, follow=[TRAINER])
    tracker = DownloadTracker(state, feed)
    feed.in_flight = [DownloadStatus(TRAINER, 3, 1, 4, 250, 1000)]
    tracker.tick()
    assert state.checkpoint_progress["version"] == 3
    assert state.checkpoint_progress["shards_done"] == 1
    assert not state.checkpoint_progress["complete"] and list(state.downloads) == []

    feed.in_flight = []
    feed.deliver(TRAINER, 3, tmp_path / "v3", size=1000, downloaded=750, shards=4)
    assert state.checkpoint_progress["complete"]
    # a version that started and finished between two ticks is recorded too (issue 29.3)
    feed.deliver(TRAINER, 4, tmp_path / "v4", size=1000, downloaded=1000, shards=4)
    feed.deliver(TRAINER, 5, tmp_path / "v5", size=1000, downloaded=0)  # all on disk already
    tracker.tick()
    assert [(d["version"], d["policy_id"], d["bytes"]) for d in state.downloads] == [
        (3, TRAINER, 750), (4, TRAINER, 1000)]
    assert state.counters["bytes_downloaded"] == 1750


async def test_a_relay_names_a_followed_trainer_that_never_appears_then_sees_it(
        tmp_path, caplog):
    cfg = Config.model_validate({"node": {"data_dir": str(tmp_path), "role": "relay",
                                          "follow": [TRAINER]}})
    ident = Identity.generate()
    feed = FakeFeed(tmp_path, follow=[TRAINER], chosen=TRAINER)
    role = RelayRole(cfg, ident, FakeP2P(), NodeState(ident.peer_id, "relay", "s"), feed=feed)
    role.follow_wait_s = 0.2
    try:
        with caplog.at_level(logging.INFO, logger="swarm_node"):
            await role.start()
            await async_wait_until(lambda: "follow" in role.state.extra, 10,
                                   "the follow problem in /status")
            follow = dict(role.state.extra["follow"])
            feed.deliver(TRAINER, 1, tmp_path / "v1", size=1000)  # it appears
            await async_wait_until(lambda: role.state.extra["follow"]["seen"], 10,
                                   "the trainer seen")
    finally:
        await role.close()
    assert follow["trainer"] == TRAINER and follow["seen"] is False
    assert TRAINER in follow["problem"]
    told = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING
            and "followed trainer" in r.getMessage()]
    assert told == [follow["problem"]]


