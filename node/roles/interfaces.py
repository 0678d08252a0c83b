"""What a role consumes, as small interfaces, and the adapters over the real parts.

A role never reads its collaborators' internals (the broadcaster's download tuples, its
store or gate): it gets
- a `CheckpointFeed`: the checkpoints of the followed policies, each handed over once it is
  downloaded and every shard verified, and the verified directory of (policy, version);
- a `RolloutSink`: where a finished rollout batch goes (gossip, in the node);
- a `Verifier` per policy (the trainer): one result per completion of a batch;
- a `CheckpointPublisher` (the trainer): its own versions, where each is kept and how a new
  one goes out; it, not the role, decides how many versions are kept.
The real ones are `BroadcastFeed` (over node/broadcast's Broadcaster), `GossipRollouts`
(over the p2p host), verifier/checks.py's RolloutVerifier and `OwnCheckpoints` (the
trainer's checkpoint store and its broadcaster). Unit tests pass in-memory fakes
(tests/node/roles/), and the integration swarm test proves the real ones.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from ...protocol.messages import RolloutBatch
from ...verifier.rules import retention
from ..broadcast.service import Broadcaster, Completed
from ..diskspace import DiskWatch
from ..lifecycle import Changed
from ..p2p import Transport

if TYPE_CHECKING:  # for annotations only: verifier.checks loads torch, which a relay never needs
    from ...verifier.checks import RolloutResult, SpotCheck


@dataclass(frozen=True)
class VerifiedCheckpoint:
    """A checkpoint whose manifest passed the gate and whose shards were all verified."""

    policy_id: str
    version: int
    path: Path
    size: int  # bytes of all shards
    downloaded: int = 0  # bytes of verified shards fetched from peers for it (0: none)
    seconds: float = 0.0  # from its accepted manifest to the verified checkpoint
    shards: int = 0
    stored: bool = False  # found complete on disk at start (a restart), not downloaded now


@dataclass(frozen=True)
class DownloadStatus:
    """One checkpoint download in progress (for /status)."""

    policy_id: str
    version: int
    shards_have: int
    shards_total: int
    bytes_done: int
    bytes_total: int


OnCheckpoint = Callable[[VerifiedCheckpoint], None]


class CheckpointFeed(Protocol):
    disk: DiskWatch  # where the feed writes; a paused disk also pauses the role's own writes
    changed: Changed  # fires when a download starts or ends, or a trainer is chosen

    def listen(self, on_checkpoint: OnCheckpoint) -> None:
        """Call `on_checkpoint` for each verified checkpoint, once, in version order per
        policy; only checkpoints of followed policies are ever handed over."""

    def chosen(self) -> str | None:
        """The trainer a follower adopted (configured, kept, or announced); None before."""

    def follow_problem(self) -> str | None:
        """Why no trainer was adopted (e.g. the bootstrap peers disagree), when known."""

    def follows(self, policy_id: str) -> bool: ...

    def path(self, policy_id: str, version: int) -> Path | None:
        """The verified directory of (policy, version), or None when not (or no longer) here."""

    def latest_version(self, policy_id: str) -> int:
        """The newest complete version of `policy_id` here (-1 when none)."""

    def downloads(self) -> list[DownloadStatus]: ...

    def counters(self) -> dict[str, int]:
        """What the feed did since start (downloads, bytes, manifests, shards served), by
        name, for /metrics."""

    async def start(self) -> None: ...

    async def close(self) -> None: ...


class Verifier(Protocol):
    def verify(self, batch: RolloutBatch, sender: str,
               spot_check: SpotCheck | None = None) -> list[RolloutResult]:
        """One result per completion, in order (worker thread)."""


class RolloutSink(Protocol):
    async def publish(self, batch: RolloutBatch) -> None:
        """Send one signed batch on its way; raises when it could not be sent."""


class GossipRollouts:
    """The node's rollout sink: the `rollouts` gossip topic."""

    def __init__(self, p2p: Transport):
        self.p2p = p2p

    async def publish(self, batch: RolloutBatch) -> None:
        await self.p2p.publish("rollouts", batch)


class BroadcastFeed:
    """A `CheckpointFeed` over the broadcaster (node/broadcast/service.py)."""

    def __init__(self, broadcaster: Broadcaster):
        self.broadcaster = broadcaster
        self.disk = broadcaster.disk
        self.changed = broadcaster.follower.changed
        self._listeners: list[OnCheckpoint] = []
        broadcaster.on_complete = self._handed_over
        broadcaster.on_loaded = self._hand_over_stored

    @classmethod
    def create(cls, p2p: Transport, cfg, root: Path, **kwargs) -> BroadcastFeed:
        """`Broadcaster(p2p, cfg, root, **kwargs)` behind the feed interface."""
        return cls(Broadcaster(p2p, cfg, root, **kwargs))

    def _handed_over(self, done: Completed) -> None:
        m = done.manifest
        ckpt = VerifiedCheckpoint(m.policy_id, m.version, Path(done.path), m.total_size,
                                  done.fetched, done.seconds, m.num_shards)
        for on_checkpoint in self._listeners:
            on_checkpoint(ckpt)

    def _hand_over_stored(self) -> None:
        """After a restart: the newest complete version of each followed policy found on
        disk, handed over like a finished download, so the role starts from it rather than
        from the base model. Its swarm settings are checked again first, as a downloaded
        manifest's are (this node's settings may have changed since); a refused one is not
        handed over (the check says why, once)."""
        b = self.broadcaster
        check = b.gate.settings_check
        for policy_id in sorted(b.gate.follow):
            version = b.store.current_version(policy_id)
            entry = b.store.get(policy_id, version)
            if entry is None:
                continue
            m = entry.manifest
            if check is not None and check(m.settings, policy_id, version) is not None:
                continue
            ckpt = VerifiedCheckpoint(policy_id, version, entry.checkpoint_dir, m.total_size,
                                      shards=m.num_shards, stored=True)
            for on_checkpoint in self._listeners:
                on_checkpoint(ckpt)

    def listen(self, on_checkpoint: OnCheckpoint) -> None:
        self._listeners.append(on_checkpoint)

    def chosen(self) -> str | None:
        choice = self.broadcaster.choice
        return choice.chosen if choice is not None else None

    def follow_problem(self) -> str | None:
        choice = self.broadcaster.choice
        return choice.problem if choice is not None else None

    def follows(self, policy_id: str) -> bool:
        return self.broadcaster.gate.follows(policy_id)

    def path(self, policy_id: str, version: int) -> Path | None:
        return self.broadcaster.path(policy_id, version)

    def latest_version(self, policy_id: str) -> int:
        return self.broadcaster.store.current_version(policy_id)

    def served(self) -> dict[str, int]:
        """Checkpoint bytes uploaded to each peer since start (whole answers)."""
        return dict(self.broadcaster.server.served_to)

    def swarm(self, max_peers: int = 64) -> dict:
        """What this node learned of the swarm's versions from the adverts of the followed
        policies (for /status `extra.swarm`): each version known (held here, complete or
        not, or advertised by peers) with its holders' count, and for each advertising peer
        the newest version it holds (complete or partly), at most `max_peers` of them."""
        b = self.broadcaster
        versions: dict[tuple[str, int], dict] = {}
        peers: dict[str, dict] = {}
        for key, entry in list(b.store.entries.items()):
            versions[key] = {"policy_id": key[0], "version": key[1], "holders": 0,
                             "here": "complete" if entry.complete else "partial"}
        for rec in list(b.records):
            v = versions.setdefault(rec.key, {"policy_id": rec.policy_id,
                                              "version": rec.version, "holders": 0,
                                              "here": ""})
            v["holders"] = len(rec.holders)
            for peer, holdings in list(rec.holders.items()):
                known = peers.get(peer)
                if known is None or (known["version"], known["complete"]) < (
                        rec.version, holdings is None):
                    peers[peer] = {"policy_id": rec.policy_id, "version": rec.version,
                                   "complete": holdings is None}
        newest = sorted(peers.items(), key=lambda kv: -kv[1]["version"])[:max_peers]
        return {"versions": sorted(versions.values(),
                                   key=lambda v: (v["policy_id"], -v["version"]))[:32],
                "holders": dict(newest)}

    def downloads(self) -> list[DownloadStatus]:
        out = []
        for job in list(self.broadcaster.follower.jobs.values()):
            d = job.downloader
            if d is None:
                continue
            m = d.entry.manifest
            done = d.progress.done if d.progress is not None else 0
            out.append(DownloadStatus(m.policy_id, job.version, len(d.entry.have),
                                      m.num_shards, done, m.total_size))
        return out

    def counters(self) -> dict[str, int]:
        return self.broadcaster.counters()

    async def start(self) -> None:
        await self.broadcaster.start()

    async def close(self) -> None:
        await self.broadcaster.close()


class CheckpointPublisher(Protocol):
    """A trainer's own versions. Retention is the publisher's: at least
    trainer.max_staleness + 1 + verifier.queue_grace versions (verifier/rules.py), so an
    honest peer at the largest allowed lag still finds the version it sampled with, also
    after its batch waited in the verification queue."""

    def path(self, policy_id: str, version: int) -> Path | None:
        """The directory of this trainer's own `version`, or None when not (or no longer) kept."""

    def latest_version(self, policy_id: str) -> int: ...

    async def publish_latest(self) -> int:
        """Announce the trainer's newest checkpoint to followers; returns its version."""

    async def start(self) -> None: ...

    async def close(self) -> None: ...


class OwnCheckpoints:
    """The real `CheckpointPublisher`: the trainer's checkpoint store (node/trainer/
    checkpoint.py) holds its versions, which need no download nor verification; its
    broadcaster announces them and serves their shards. `followed` is a `CheckpointFeed` of
    the followed policies over the same broadcaster (started and closed with this)."""

    def __init__(self, trainer, broadcaster: Broadcaster, keep: int):
        self.trainer = trainer
        self.broadcaster = broadcaster
        trainer.store.keep = keep

    @cached_property
    def followed(self) -> BroadcastFeed:
        return BroadcastFeed(self.broadcaster)

    @classmethod
    def create(cls, trainer, p2p: Transport, cfg, root: Path, *, follow: list[str],
               settings) -> OwnCheckpoints:
        """Over `Broadcaster(p2p, ...)`, both stores keeping `retention(cfg, ...)` versions:
        the trainer's own and each followed policy's (verified up to the same lag)."""
        bcfg = cfg.broadcast.model_copy(update={"keep_versions": retention(
            cfg, cfg.broadcast.keep_versions)})
        broadcaster = Broadcaster(p2p, bcfg, root, follow=follow, role="trainer",
                                  settings=settings)
        return cls(trainer, broadcaster, retention(cfg, trainer.store.keep))

    def path(self, policy_id: str, version: int) -> Path | None:
        for ck in self.trainer.store.list():
            if ck.version == version:
                return ck.policy_dir
        return None

    def latest_version(self, policy_id: str) -> int:
        return self.trainer.version

    async def publish_latest(self) -> int:
        """Only the policy directory leaves the node (the optimizer state in the
        checkpoint's trainer/ directory never does). The broadcaster's store hard-links the
        files, so pruning old checkpoints does not pull them from under peers still
        downloading."""
        ckpt = self.trainer.latest_checkpoint()
        parent = ckpt.version - 1 if ckpt.version > 0 else -1
        await self.broadcaster.publish(ckpt.policy_dir, ckpt.version, parent_version=parent)
        return ckpt.version

    async def start(self) -> None:
        await self.broadcaster.start()

    async def close(self) -> None:
        await self.broadcaster.close()
