"""The trainer role's checkpoint publication through its `CheckpointPublisher`: the loop
announces each checkpointed version once and nothing else, and the real publisher
(`OwnCheckpoints`) keeps trainer.max_staleness + 1 + verifier.queue_grace versions, own and
followed, and announces only the policy directory with its parent version. Real trainer processes
publishing to real followers: tests/integration (the swarm and operator tests)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from swarm_node.node.config import Config
from swarm_node.node.identity import Identity
from swarm_node.node.metrics import NodeState
from swarm_node.node.roles.interfaces import OwnCheckpoints
from swarm_node.node.roles.trainer import TrainerRole
from swarm_node.node.runtime import BatchLimit
from swarm_node.node.trainer.checkpoint import Checkpoint, CheckpointStore
from swarm_node.node.trainer.trainer import StepStats
from swarm_node.verifier.reputation import Reputation

from .fakes import FakeFeed, FakeP2P, FakePublisher


class SteppingTrainer:
    """One version per step; versions in `checkpointed` end with a checkpoint. At
    `last_version` it sets `stop` (from the worker thread, as the role runs it)."""

    def __init__(self, checkpointed: set[int], last_version: int, stop: asyncio.Event):
        self.version = 0
        self.micro_batch = BatchLimit("trainer.micro_batch_size", 4)
        self.checkpointed, self.last_version, self.stop = checkpointed, last_version, stop
        self.loop = asyncio.get_running_loop()

    def step(self) -> StepStats:
        self.version += 1
        if self.version == self.last_version:
            self.loop.call_soon_threadsafe(self.stop.set)
        ckpt = f"step-{self.version:08d}" if self.version in self.checkpointed else None
        return StepStats(self.version, True, groups_local=1, tokens=8, seconds=0.01,
                         checkpoint=ckpt)

    def counters(self) -> dict[str, int]:
        return {}

    def undo_failed_step(self) -> int:
        return 0

    def close(self) -> None:
        pass


def config(tmp_path, **trainer) -> Config:
    return Config.model_validate({"node": {"data_dir": str(tmp_path), "role": "trainer",
                                           "swarm_id": "unit"},
                                  "trainer": {"sample_locally": False, **trainer}})


async def test_each_checkpointed_version_is_published_once_through_the_publisher(tmp_path):
    stop = asyncio.Event()
    ident = Identity.generate()
    trainer = SteppingTrainer(checkpointed={1, 3}, last_version=4, stop=stop)
    publisher = FakePublisher(trainer)
    role = TrainerRole(config(tmp_path), ident, FakeP2P(),
                       NodeState(ident.peer_id, "trainer", "unit"),
                       feed=FakeFeed(tmp_path), own=publisher)
    role.trainer = trainer
    role.intake = role.build_intake(Reputation(None))
    try:
        await asyncio.wait_for(role.run(stop), timeout=60)
    finally:
        await role.close()
    assert trainer.version == 4
    assert publisher.published == [1, 3]  # v2 and v4 had no checkpoint: nothing to announce
    assert role.state.versions_published == 2
    assert publisher.closed  # the role closes what it publishes through


class RecordingBroadcaster:
    def __init__(self):
        self.published: list[tuple[Path, int, int]] = []

    async def publish(self, ckpt_dir: Path, version: int, parent_version: int = -1) -> None:
        self.published.append((ckpt_dir, version, parent_version))


class CheckpointedTrainer:
    """A trainer's checkpoint side: a real store; `latest_checkpoint()` as Trainer's."""

    def __init__(self, root: Path, keep: int):
        self.store = CheckpointStore(root, keep=keep)
        self.version = 0

    def latest_checkpoint(self) -> Checkpoint:
        return Checkpoint(self.store.root / f"step-{self.version:08d}", self.version)


def test_the_publisher_keeps_versions_for_the_largest_allowed_lag(tmp_path):
    cfg = config(tmp_path, max_staleness=5, keep_checkpoints=2).with_overrides(
        {"broadcast.keep_versions": 2})
    trainer = CheckpointedTrainer(tmp_path / "checkpoints", keep=cfg.trainer.keep_checkpoints)
    own = OwnCheckpoints.create(trainer, FakeP2P(), cfg, tmp_path / "broadcast", follow=[],
                                settings=None)
    # own versions: max_staleness + 1, + 2 (verifier.queue_grace: batches that waited in the
    # verification queue are judged as of their arrival)
    assert trainer.store.keep == 8
    assert own.broadcaster.store.keep_versions == 8  # followed policies' versions too
    big = config(tmp_path, max_staleness=1, keep_checkpoints=9)
    trainer = CheckpointedTrainer(tmp_path / "checkpoints-big", keep=9)
    OwnCheckpoints.create(trainer, FakeP2P(), big, tmp_path / "broadcast-big", follow=[],
                          settings=None)
    assert trainer.store.keep == 9  # a larger configured retention stays


async def test_the_publisher_announces_the_policy_directory_with_its_parent(tmp_path):
    trainer = CheckpointedTrainer(tmp_path / "checkpoints", keep=3)
    broadcaster = RecordingBroadcaster()
    own = OwnCheckpoints(trainer, broadcaster, keep=3)
    for version in (0, 1):
        trainer.version = version
        assert await own.publish_latest() == version
    ckpts = trainer.store.root
    assert broadcaster.published == [(ckpts / "step-00000000" / "policy", 0, -1),
                                     (ckpts / "step-00000001" / "policy", 1, 0)]
