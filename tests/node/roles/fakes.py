"""In-memory stand-ins for what a role consumes (node/roles/interfaces.py): a checkpoint feed
the test drives by hand, a rollout sink and a checkpoint publisher that record, and the p2p
host (the shipped in-memory Transport, node/testing/transport.py). They test the roles' logic; the real feed, sink and publisher are
proven by tests/integration."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from swarm_node.node.diskspace import DiskWatch
from swarm_node.node.identity import Identity
from swarm_node.node.lifecycle import Changed
from swarm_node.node.roles.interfaces import DownloadStatus, VerifiedCheckpoint
from swarm_node.node.testing.transport import FakeTransport
from swarm_node.protocol.messages import RolloutBatch


class FakeFeed:
    """A `CheckpointFeed`: `deliver()` hands a checkpoint over like a finished download."""

    def __init__(self, root: Path, follow: list[str] = (), chosen: str | None = None):
        self.disk = DiskWatch("fake feed", root)
        self.followed = set(follow)
        self._chosen = chosen
        self.listeners: list[Callable[[VerifiedCheckpoint], None]] = []
        self.paths: dict[tuple[str, int], Path] = {}
        self.in_flight: list[DownloadStatus] = []
        self.changed = Changed()
        self.started = self.closed = False

    def listen(self, on_checkpoint) -> None:
        self.listeners.append(on_checkpoint)

    def choose(self, policy_id: str) -> None:
        """What the broadcaster does when the bootstrap peer announces its trainer."""
        self._chosen = policy_id
        self.followed.add(policy_id)
        self.changed.fire()

    def start_download(self, status: DownloadStatus) -> None:
        """A download of the feed's begins (shown until `deliver`)."""
        self.in_flight.append(status)
        self.changed.fire()

    def deliver(self, policy_id: str, version: int, path: Path, size: int = 1,
                downloaded: int = 0, shards: int = 1) -> None:
        self.paths[(policy_id, version)] = Path(path)
        self.in_flight = [d for d in self.in_flight
                          if (d.policy_id, d.version) != (policy_id, version)]
        for on_checkpoint in self.listeners:
            on_checkpoint(VerifiedCheckpoint(policy_id, version, Path(path), size, downloaded,
                                             0.5, shards))
        self.changed.fire()

    def chosen(self) -> str | None:
        return self._chosen

    def follow_problem(self) -> str | None:
        return None

    def follows(self, policy_id: str) -> bool:
        return policy_id in self.followed

    def path(self, policy_id: str, version: int) -> Path | None:
        return self.paths.get((policy_id, version))

    def latest_version(self, policy_id: str) -> int:
        return max((v for p, v in self.paths if p == policy_id), default=-1)

    def downloads(self) -> list[DownloadStatus]:
        return list(self.in_flight)

    def counters(self) -> dict[str, int]:
        return {"downloads_completed": len(self.paths)}

    async def start(self) -> None:
        self.started = True

    async def close(self) -> None:
        self.closed = True


class RecordingSink:
    """A `RolloutSink` that keeps every batch; `on_publish(batch, n)` runs after each."""

    def __init__(self, on_publish: Callable[[RolloutBatch, int], None] | None = None,
                 fail: int = 0):
        self.batches: list[RolloutBatch] = []
        self.on_publish = on_publish
        self.fail = fail  # the first `fail` publishes raise, like a gossip error

    async def publish(self, batch: RolloutBatch) -> None:
        if self.fail > 0:
            self.fail -= 1
            raise ConnectionError("no peers in the mesh")
        self.batches.append(batch)
        if self.on_publish is not None:
            self.on_publish(batch, len(self.batches))


class FakePublisher:
    """A `CheckpointPublisher` over a trainer: records each version it is asked to announce."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.published: list[int] = []
        self.started = self.closed = False

    def path(self, policy_id: str, version: int) -> Path | None:
        return None

    def latest_version(self, policy_id: str) -> int:
        return self.trainer.version

    async def publish_latest(self) -> int:
        self.published.append(self.trainer.version)
        return self.trainer.version

    async def start(self) -> None:
        self.started = True

    async def close(self) -> None:
        self.closed = True


class FakeP2P(FakeTransport):
    """The role's p2p host: a member of a network of its own (records what it publishes)."""

    def __init__(self):
        super().__init__(Identity.generate())
