"""Trainer: verify incoming rollouts, train on a SAPO mix, checkpoint, broadcast each version.

Wiring only: the intake (verifier/intake.py) owns the verification queue, budgets,
reputation, sequential tests, bans, penalties and verdicts; the `Trainer`
(node/trainer/trainer.py) owns the model, its modes and its buffer. Loop, one iteration per
policy version:
  1. the intake verifies the batches that arrived and hands the accepted ones to the
     trainer's crash-safe buffer;
  2. sample this node's own rollouts for the round (SAPO: every trainer also samples),
     unless the local groups waiting (peers' first) already fill the next step; before
     it, a few newcomers' first batches while the intake's probation share is raised;
  3. one GRPO step on I local + J external groups, a checkpoint, and a signed manifest of
     the new version for the inference peers and relays.
Rollouts of this trainer's own policy are verified against the version that produced them
(kept on disk for `max_staleness` versions). Rollouts of another policy are verified only
when this node holds that policy's checkpoint (it follows that trainer); otherwise they are
rejected as `unknown_policy`, never trained on unverified. A stop (Ctrl-C) takes no new
work: the step in flight finishes, nothing else does.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

from ...protocol.messages import Verdict
from ...verifier.checks import CheckSettings, RolloutVerifier
from ...verifier.intake import Intake
from ...verifier.rules import batch_rules
from ...verifier.seen import SeenStore
from ..diskspace import DiskWatch, until_written
from ..models import ensure_builtin, load_model
from ..sampler.factory import sampling_params
from ..sampler.hf import HFSampler
from ..sampler.rounds import sample_round
from ..sampler.stops import context_limit
from ..tasks import PromptStyle, TaskSource
from ..trainer.distributed import attach_ranks
from ..trainer.group import attach_group
from ..trainer.hooks import StepHooks
from ..trainer.progress import StepProgress, duration
from ..trainer.trainer import Trainer
from .base import Role, freeze_heap
from .interfaces import CheckpointFeed, CheckpointPublisher, OwnCheckpoints, Verifier
from .settings import swarm_settings

log = logging.getLogger("swarm_node")

MODEL_CACHE = 4
PEER_BATCH_POLL_S = 0.5  # re-check the deadline while waiting for peers' batches
IDLE_AFTER_EMPTY_STEP_S = 1.0  # nothing to train on: wait before trying again


class TrainerRole(Role):
    name = "trainer"

    def __init__(self, cfg, identity, p2p, state, *, feed: CheckpointFeed | None = None,
                 own: CheckpointPublisher | None = None,
                 verifier_for: Callable[[str], Verifier] | None = None):
        super().__init__(cfg, identity, p2p, state)
        # followed policies' verified checkpoints; None: the broadcaster's, built in start()
        self.feed = feed
        # this trainer's own versions and their publication; None: built in start()
        self.own = own
        self.verifier_for = verifier_for or self._verifier  # policy id -> its verifier
        self.intake: Intake | None = None  # built in start(), once the trainer is loaded
        self.trainer = None
        self.sampler = None
        self.tasks = None
        self.disk = DiskWatch("training writes (buffer, checkpoints)", self.data_dir)
        self.verifiers: dict[str, object] = {}
        self._models: OrderedDict[tuple[str, int], object] = OrderedDict()
        self.round = int(self.load_json("round.json", {"next_round": 0})["next_round"])
        # the step in progress: what the loop waits for, the groups gathered, the ETA
        self.progress = StepProgress((cfg.trainer.local_items, cfg.trainer.external_items),
                                     self._groups, version=0)

    # start-up ---------------------------------------------------------------------------

    def prepare(self) -> None:
        """Load the model and the trainer's state (scale-out ranks and group included: none
        of it needs this node's swarm) while the host joins the swarm."""
        self.begin_load("loading the model and the trainer's state", self._load_trainer)

    def _load_trainer(self) -> Trainer:
        name = self.cfg.model.name
        model_dir = ensure_builtin(name) if name.startswith("builtin:") else name
        return Trainer(self.cfg, model_dir, self.data_dir, policy_id=self.identity.peer_id,
                       scale_out=self._scale_out)

    async def start(self) -> None:
        cfg = self.cfg
        self.trainer = await self.loaded()  # begun by the runner unless a test starts it
        self.sampler = HFSampler(self.trainer.model, self.trainer.tokenizer,
                                 peer_id=self.identity.peer_id, version=self.trainer.version,
                                 max_context=cfg.model.max_context,
                                 max_batch=cfg.sampler.max_batch)
        self.count_sampling(lambda: self.sampler)
        self.progress.version = self.trainer.version
        self.state.extra["step"] = self.progress.view
        self.state.metrics.before_read(self.progress.refresh)
        self.tasks = TaskSource.of(cfg.tasks, cfg.node.swarm_id)
        self.intake = self.build_intake()
        self.p2p.set_peer_filter(lambda peer: not self.intake.is_banned(peer))
        # peers with verified history here (out of probation): the gossip admission's
        # priority and the bulk plane's reserve of known peers
        self.p2p.set_established(self.intake.established)
        if self.own is None:
            own = OwnCheckpoints.create(self.trainer, self.p2p, cfg, self.data_dir / "broadcast",
                                        follow=[p for p in cfg.node.follow
                                                if p != self.identity.peer_id],
                                        settings=swarm_settings(cfg))
            self.own = own
            if self.feed is None:
                self.feed = own.followed  # same broadcaster: started and closed with `own`
        await self.own.start()
        if self.feed is not None:  # the broadcaster's counters (served, downloaded) at /metrics
            self.state.add_counters("broadcast", self.feed.counters)
            self.watch_swarm(self.feed)  # the followed trainers' versions, its own
        await self.p2p.subscribe("rollouts", self.intake.offer)
        await self.p2p.subscribe("verdicts", self.intake.hint)
        await self.watch_verdicts()
        self.state.policy_id = self.identity.peer_id
        self.state.policy_version = self.trainer.version
        self.state.extra["disk"] = self.disk.status()
        self.state.extra["intake"] = self.intake.view  # queue, verification time by tier
        self.state.add_counters("intake", self.intake.counters)  # the same at /metrics
        self.state.banned = self.intake.banned()
        await self._publish_version()
        freeze_heap()

    def build_intake(self, reputation=None, limits=None) -> Intake:
        """The intake over this role's trainer, verifiers, p2p host and worker thread (a
        given `reputation` / `limits` replace the configured ones: tests)."""
        return Intake.for_trainer(self.cfg, self.identity.peer_id, self._verifier_for_batch,
                                  self.trainer, self.state, reputation=reputation,
                                  limits=limits, publish=self._publish_verdict,
                                  work=self.work, disk=self.disk, trusted=self._followed,
                                  report=self.p2p.report_misbehaviour,
                                  introducer=self.p2p.introducer)

    def _groups(self) -> tuple[int, int]:
        """Groups (with reward signal: the others are dropped on arrival) waiting in the
        buffer for a step: (of this policy, of other policies)."""
        buffer = self.trainer.buffer
        return buffer.count("local"), buffer.count("external")

    def _scale_out(self, trainer: Trainer) -> StepHooks:
        """Scale-out (SCALE-OUT), the trainer's hooks: a trainer group (trainer.group) and
        the other ranks of this trainer (join --procs N); both none when not configured."""
        self.group = attach_group(trainer, self.cfg, self.data_dir)
        return StepHooks(grad_sync=attach_ranks(trainer),
                         after_step=self.group.after_step if self.group is not None else None)

    async def _publish_version(self) -> None:
        """Announce the current checkpoint (what leaves the node, and how many versions are
        kept, is the publisher's business). Storing it for the broadcast writes (links or
        copies, a manifest): on a full disk that pauses like the trainer's other writes
        instead of ending the node (a retry reuses what the first attempt stored)."""
        await until_written(self.disk, self.own.publish_latest)
        self.state.versions_published += 1

    # verification -----------------------------------------------------------------------

    def _followed(self, peer: str) -> bool:
        """A trainer this one follows (its verdicts are hints like an established peer's)."""
        return peer != self.identity.peer_id and self.feed is not None and self.feed.follows(peer)

    def _verifier_for_batch(self, policy_id: str) -> Verifier | None:
        """The verifier of `policy_id`: this trainer's own policy or a followed one's; None
        for any other (not verifiable here: `unknown_policy`)."""
        if policy_id == self.identity.peer_id or self._followed(policy_id):
            return self.verifier_for(policy_id)
        return None

    async def _publish_verdict(self, verdict: Verdict) -> None:
        await self.p2p.publish("verdicts", verdict)

    def _model_for(self, policy_id: str):
        def model_for(version: int):
            if policy_id == self.identity.peer_id and version == self.trainer.version:
                return self.trainer.model
            key = (policy_id, version)
            if key in self._models:
                self._models.move_to_end(key)
                return self._models[key]
            path = self._checkpoint_path(policy_id, version)
            if path is None:
                return None

            model, _ = load_model(path, dtype=self.cfg.model.dtype,
                                  device=str(self.trainer.device))
            self._models[key] = model
            while len(self._models) > MODEL_CACHE:
                self._models.popitem(last=False)
            return model
        return model_for

    def _checkpoint_path(self, policy_id: str, version: int) -> Path | None:
        source = self.own if policy_id == self.identity.peer_id else self.feed
        return source.path(policy_id, version)

    def _latest_for(self, policy_id: str):
        def latest() -> int:
            if policy_id == self.identity.peer_id:
                return self.trainer.version
            return self.feed.latest_version(policy_id)
        return latest

    def _verifier(self, policy_id: str):
        v = self.verifiers.get(policy_id)
        if v is None:
            cfg = self.cfg
            model = self.trainer.model
            settings = CheckSettings.for_dtype(cfg.model.dtype,
                                               max_policy_lag=cfg.trainer.max_staleness,
                                               queue_grace=cfg.verifier.queue_grace)
            seen = SeenStore(self.data_dir / "verifier" / f"seen-{policy_id[-16:]}.sqlite")
            v = RolloutVerifier(
                self._model_for(policy_id), self.trainer.tokenizer, self.tasks,
                swarm_id=cfg.node.swarm_id, latest_version=self._latest_for(policy_id),
                settings=settings, policy_ids={policy_id},
                sampling=sampling_params(cfg),
                max_context=context_limit(model.config, cfg.model.max_context),
                format_reward=cfg.tasks.format_reward, rules=batch_rules(cfg),
                style=PromptStyle.of(cfg.tasks),
                dtype=cfg.model.dtype, generation_config=getattr(model, "generation_config",
                                                                 None),
                seen=seen)
            self.verifiers[policy_id] = v
        return v

    # the loop ---------------------------------------------------------------------------

    def sample_local(self, round_: int) -> int:
        """Sample this trainer's own rollouts for `round_` into the buffer (worker thread).

        The sampler shares the trainer's model object, so it always samples the current
        version; no weight copy is needed."""
        self.sampler.version = self.trainer.version
        with self.trainer.sampling():
            samples = sample_round(self.sampler, self.trainer.tokenizer, self.tasks,
                                   self.identity.peer_id, round_,
                                   self.cfg.tasks.tasks_per_round,
                                   self.cfg.sampler.completions_per_task,
                                   sampling_params(self.cfg),  # the one builder: every field
                                   style=PromptStyle.of(self.cfg.tasks))
        self.trainer.add_local(samples)
        return len(samples)

    async def _own_round_wanted(self) -> bool:
        """Sample this trainer's own round (SAPO: every trainer samples) unless the local
        groups already waiting fill the next step's I slots: peers' groups go first
        (trainer.py), so own samples beyond that would only wait and go stale (counted
        `sampling_rounds_skipped`). With local_items 0 it samples as before (its reward)."""
        tc = self.cfg.trainer
        if not tc.sample_locally:
            return False
        if tc.local_items and await self.work(self.trainer.local_room) == 0:
            self.state.count("sampling_rounds_skipped")
            return False
        return True

    async def _wait_for_peers(self, stop: asyncio.Event) -> None:
        """Pace steps by the swarm: wait for `peer_batches_per_step` verified peer batches
        (at most `peer_wait_s`), verifying them as they arrive. The trainer is idle here, so
        the intake may lend the time to senders on probation."""
        need = self.cfg.trainer.peer_batches_per_step
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.cfg.trainer.peer_wait_s
        if need:
            self.progress.set("waiting_for_peers", lambda: (
                f"waiting for rollout batches from peers: {self.intake.verified_batches} of "
                f"{need} verified (steps on what it has in "
                f"{duration(max(0.0, deadline - loop.time()))})"))
        while (self.intake.verified_batches < need and not stop.is_set()
               and loop.time() < deadline):
            await self.intake.wait(stop, min(PEER_BATCH_POLL_S, deadline - loop.time()),
                                   idle=True)
            await self.intake.drain(stop, idle=True)

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            if self.cfg.trainer.max_steps and self.trainer.version >= self.cfg.trainer.max_steps:
                # Checked before a step, so a restart at max_steps trains nothing more.
                log.info("reached trainer.max_steps = %d at v%d; idling (serving checkpoints)",
                         self.cfg.trainer.max_steps, self.trainer.version)
                self.progress.set("done", f"reached trainer.max_steps = "
                                          f"{self.cfg.trainer.max_steps}: serving checkpoints")
                await stop.wait()
                return
            self.progress.set("verifying", "verifying the rollout batches peers sent")
            await self.intake.drain(stop)
            # newcomers' first batches before this trainer's own round, while recent
            # probation work verified (the intake's priced newcomer lane, issue 27)
            await self.intake.lend_to_newcomer(stop)
            if await self._own_round_wanted() and not stop.is_set():
                self.progress.set("sampling", f"sampling this trainer's own rollouts (round "
                                              f"{self.round})")
                await until_written(self.disk, self.work_oom_safe, self.sample_local, self.round,
                                    limit=self.sampler.batch)
                self.round += 1
                await until_written(self.disk, self.work, self.save_json, "round.json",
                                    {"next_round": self.round})
            await self.intake.drain(stop)
            await self._wait_for_peers(stop)
            self.intake.verified_batches = 0
            if stop.is_set():
                return  # a stop takes no new work: no step starts after it
            self.progress.set("training", f"training step -> v{self.trainer.version + 1}")
            stats = await until_written(self.disk, self.work_oom_safe, self.trainer.step,
                                        limit=self.trainer.micro_batch,
                                        on_oom=self.trainer.undo_failed_step)
            self.state.observe("train_step_seconds", stats.seconds)
            self.state.banned = self.intake.banned()  # bans also expire
            self.state.buffer_counters = self.trainer.counters()
            if not stats.trained:  # nothing to train on: idle, so probation work may have it
                self.progress.set("waiting_for_groups", (
                    "nothing to train on: waiting for groups with reward signal "
                    + ("(from peers or this trainer's sampling)"
                       if self.cfg.trainer.sample_locally else "from peers")))
                await self.intake.wait(stop, IDLE_AFTER_EMPTY_STEP_S, idle=True)
                await self.intake.drain(stop, idle=True)
                continue
            self.state.policy_version = stats.version
            self.progress.stepped(stats.version)
            reward = stats.mean_reward_local_new
            if not math.isnan(reward):
                self.state.reward = reward
                self.state.reward_history.append((stats.version, reward))
            self.state.count("train_steps")
            self.state.count("tokens_trained", stats.tokens)
            self.state.record_step(stats.version, None if math.isnan(reward) else reward,
                                   loss=stats.loss, tokens_per_s=stats.tokens_per_s,
                                   step_seconds=stats.seconds)
            # "of this policy": sampled here or by peers following it (SAPO's "local"
            # items); "of other policies": the followed trainers' (SAPO's "external")
            log.info("train step -> v%d: %d groups of this policy + %d of other policies, "
                     "%d tokens, reward %.3f, loss %.4f, %.1f tok/s%s", stats.version,
                     stats.groups_local,
                     stats.groups_external, stats.tokens, reward, stats.loss,
                     stats.tokens_per_s, _pace(self.progress.pace_s))
            if stats.checkpoint and not stop.is_set():
                await self._publish_version()  # after a stop: announced at the next start

    async def close(self) -> None:
        if self.own is not None:
            await self.own.close()
        await super().close()
        if self.intake is not None:
            self.intake.close()
        if getattr(self, "group", None) is not None:
            self.group.close()
        if self.trainer is not None:
            self.trainer.close()


def _pace(pace_s: float | None) -> str:
    """`, 12.3 s per version` (the recent pace; the next version's ETA), or nothing yet."""
    return "" if pace_s is None else f", {pace_s:.1f} s per version"
