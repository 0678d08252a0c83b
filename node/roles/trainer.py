"""Trainer: verify incoming rollouts, train on a SAPO mix, checkpoint, broadcast each version.

Loop, one iteration per policy version:
  1. verify the rollout batches that arrived (every check in verifier/checks.py, one prefill
     per batch); accepted completions enter the crash-safe buffer, rejections are counted
     per peer and reason and feed the reputation, which bans cheaters at the gossip layer;
  2. sample this node's own rollouts for the round (SAPO: every trainer also samples);
  3. one GRPO step on I local + J external groups, a checkpoint, and a signed manifest of
     the new version for the inference peers and relays.
Rollouts of this trainer's own policy are verified against the version that produced them
(kept on disk for `max_staleness` versions). Rollouts of another policy are verified only
when this node holds that policy's checkpoint (it follows that trainer); otherwise they are
rejected as `unknown_policy`, never trained on unverified.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import numpy as np

from ...protocol.messages import RolloutBatch, TensorData
from ...verifier.checks import CheckSettings, RolloutResult, RolloutVerifier, rollout_id
from ...verifier.intake import Budget, IntakeLimits, VerificationQueue
from ...verifier.reasons import BATCH_REASONS, HONEST_MISTAKES
from ...verifier.reputation import Reputation
from ...verifier.rules import batch_rules
from ...verifier.seen import SeenStore
from ...verifier.sequential import PeerMonitor, SequentialSettings
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
from ..trainer.trainer import Trainer
from .base import Role, wait_any
from .interfaces import CheckpointFeed, CheckpointPublisher, OwnCheckpoints, Verifier
from .settings import swarm_settings

log = logging.getLogger("swarm_node")

DRAIN_MAX_S = 30.0  # longest verification stretch before training gets its turn
BOGUS_PROBATION_REPORT = 1  # connection-penalty offences per bogus probation batch
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
        # fair across senders, new keys on probation (verifier/intake.py)
        self.queue = VerificationQueue(self._established, IntakeLimits())
        self.budget = Budget(IntakeLimits())
        self.arrived = asyncio.Event()
        # per-peer bias / steering tests (verifier/sequential.py), honest parameters per dtype
        self.monitor = PeerMonitor(SequentialSettings.for_dtype(cfg.model.dtype))
        self.trainer = None
        self.sampler = None
        self.tasks = None
        self.reputation = None
        self.disk = DiskWatch("training writes (buffer, checkpoints)", self.data_dir)
        self.verifiers: dict[str, object] = {}
        self._models: OrderedDict[tuple[str, int], object] = OrderedDict()
        self.round = int(self.load_json("round.json", {"next_round": 0})["next_round"])
        self.peer_batches = 0  # verified peer batches with accepted rollouts since the last step

    # start-up ---------------------------------------------------------------------------

    async def start(self) -> None:
        cfg = self.cfg
        name = cfg.model.name
        model_dir = ensure_builtin(name) if name.startswith("builtin:") else name
        self.trainer = await self.work(Trainer, cfg, model_dir, self.data_dir,
                                       policy_id=self.identity.peer_id,
                                       scale_out=self._scale_out)
        self.sampler = HFSampler(self.trainer.model, self.trainer.tokenizer,
                                 peer_id=self.identity.peer_id, version=self.trainer.version,
                                 max_context=cfg.model.max_context,
                                 max_batch=cfg.sampler.max_batch)
        self.count_sampling(lambda: self.sampler)
        self.tasks = TaskSource.of(cfg.tasks, cfg.node.swarm_id)
        self.reputation = Reputation.from_config(cfg.verifier, self.data_dir / "reputation.json")
        self.p2p.set_peer_filter(lambda peer: not self.reputation.is_banned(peer))
        bulk = getattr(self.p2p, "bulk", None)  # peers out of probation: the plane's reserve
        if bulk is not None:
            bulk.add_known(self.reputation.established)
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
        await self.p2p.subscribe("rollouts", self._on_rollouts)
        await self.p2p.subscribe("verdicts", self._on_verdict)
        await self.watch_verdicts()
        self.state.policy_id = self.identity.peer_id
        self.state.policy_version = self.trainer.version
        self.state.extra["disk"] = self.disk.status()
        self.state.banned = self.reputation.banned()
        await self._publish_version()

    def _scale_out(self, trainer: Trainer) -> StepHooks:
        """Scale-out (SCALE-OUT), the trainer's hooks: a trainer group (trainer.group) and
        the other ranks of this trainer (join --procs N); both none when not configured."""
        self.group = attach_group(trainer, self.cfg, self.data_dir)
        return StepHooks(grad_sync=attach_ranks(trainer),
                         after_step=self.group.after_step if self.group is not None else None)

    async def _publish_version(self) -> None:
        """Announce the current checkpoint (what leaves the node, and how many versions are
        kept, is the publisher's business)."""
        await self.own.publish_latest()
        self.state.versions_published += 1

    # incoming ---------------------------------------------------------------------------

    def _established(self, sender: str) -> bool:
        return self.reputation is not None and self.reputation.established(sender)

    async def _on_rollouts(self, env, from_peer: str) -> None:
        if self.reputation.is_banned(env.sender):
            self.state.reject(env.sender, "banned", len(env.message.completions))
            return
        if not self.queue.put(env.sender, (env.message, from_peer)):
            self.state.count("rollout_queue_full")
            log.debug("verification queue: dropped a batch from %s (not verified, not "
                      "accepted)", env.sender[-8:])
        self.arrived.set()

    async def _on_verdict(self, env, from_peer: str) -> None:
        # Verdicts from others are hints: they only make the subject always-verified.
        self.reputation.hint(env.message, env.sender)

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
                                               max_policy_lag=cfg.trainer.max_staleness)
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

    def verify_and_store(self, batch: RolloutBatch, sender: str):
        """Verify one batch and store what passed (worker thread). Returns the results.

        The trainer gets only what was verified: text decoded from the verified token ids,
        the verifier's recomputed logprobs (never the claimed ones), the recomputed reward.
        Spot checks are drawn per task group with the reputation's secret key (the sender
        cannot predict them); a skipped group passes every cheap check, is marked seen, and
        goes to the trainer with NaN logprobs, which it recomputes under its current policy
        (node/trainer/trainer.py `_verified_or_none`)."""
        own = batch.policy_id == self.identity.peer_id
        known = own or (self.feed is not None and self.feed.follows(batch.policy_id))
        if not known:
            return None
        verifier = self.verifier_for(batch.policy_id)
        results = verifier.verify(
            batch, sender, spot_check=lambda ids: self.reputation.should_verify_group(sender, ids))
        accepted = [_verified_completion(batch.completions[r.index], r)
                    for r in results if r.accept]
        if accepted:
            self.trainer.add_external(batch.model_copy(update={"completions": accepted}))
        return results

    async def _drain(self) -> None:
        """Verify queued batches, fairly across senders, for at most DRAIN_MAX_S (a flood
        must not stop training)."""
        deadline = time.monotonic() + DRAIN_MAX_S
        while len(self.queue) and time.monotonic() < deadline:
            sender, (batch, from_peer) = self.queue.get()
            if self.reputation.is_banned(sender):
                self.state.reject(sender, "banned", len(batch.completions))
                continue
            established = self._established(sender)
            tokens = sum(c.completion_ids.shape[0] for c in batch.completions)
            if not self.budget.charge(sender, tokens, established):
                results = [RolloutResult(i, rollout_id(batch, c), False, "over_budget",
                                         "verification budget of this sender is spent")
                           for i, c in enumerate(batch.completions)]
            else:
                t0 = time.monotonic()
                results = await until_written(self.disk, self.work, self.verify_and_store,
                                              batch, sender)  # disk full: pause, keep batch
                self.state.observe("verify_batch_seconds", time.monotonic() - t0)
            if results is None:
                self.state.reject(sender, "unknown_policy", len(batch.completions))
                continue
            await self._after_verify(batch, sender, from_peer, results, established)

    async def _after_verify(self, batch, sender, from_peer, results, established) -> None:
        """Reputation, metrics, logs, verdicts and connection penalties of one batch."""
        first_reject = None
        batch_level = (not any(r.accept for r in results)
                       and len({r.reason for r in results}) == 1
                       and results[0].reason in BATCH_REASONS)
        if batch_level:  # one fault of the batch, not one per completion
            self.reputation.record(sender, False, results[0].reason)
        for r in results:
            if not batch_level and r.reason != "unchecked":  # trust only from checks
                self.reputation.record(sender, r.accept, r.reason)
            alarm = self.monitor.observe(sender, r.stats) if r.reason == "ok" else None
            if alarm:  # across batches: the peer, not this rollout, failed the test
                self.reputation.record(sender, False, alarm)
                self.state.count(f"sequential_{alarm}")
                log.warning("peer %s failed the %s test", sender[-8:], alarm)
                await self._publish_verdict(RolloutResult(r.index, r.rollout_id, False, alarm,
                                                          "per-peer sequential test"),
                                            sender, batch.policy_version)
            if r.accept:
                self.state.accept(sender)
            else:
                self.state.reject(sender, r.reason)
                if first_reject is None or first_reject.reason == "group_member_rejected":
                    first_reject = r  # the verdict names the cause, not the collateral
        n_ok = sum(r.accept for r in results)
        self.peer_batches += n_ok > 0
        log.info("verified round %d from %s: %d accepted, %d rejected%s", batch.round,
                 sender[-8:], n_ok, len(results) - n_ok,
                 f" (first: {first_reject.reason})" if first_reject else "")
        cheat = [r for r in results if not r.accept and r.reason not in HONEST_MISTAKES]
        report = getattr(self.p2p, "report_misbehaviour", None)
        if cheat and not established and report is not None and from_peer:
            # Sybil economics: the connection that carries fresh-key bogus batches pays.
            report(from_peer, BOGUS_PROBATION_REPORT, "bogus_batch")
        if self.reputation.is_banned(sender) and sender not in self.state.banned:
            self.state.banned = self.reputation.banned()
            log.warning("banned peer %s (reputation %.1f)", sender,
                        self.reputation.score(sender))
        if first_reject is not None:
            await self._publish_verdict(first_reject, sender, batch.policy_version)
        await self.announce_batch_verdicts(batch, sender, results)
        if self.reputation.is_banned(sender):
            await self.announce_ban(sender, results[0].rollout_id,
                                    f"reputation {self.reputation.score(sender):.1f}; "
                                    f"last reject: {first_reject.reason if first_reject else '-'}")

    async def _publish_verdict(self, result, sender: str, version: int) -> None:
        try:
            await self.p2p.publish("verdicts", result.verdict(sender, version))
        except Exception as e:  # noqa: BLE001 - a hint only; counted
            self.state.count("verdict_publish_failed")
            log.debug("verdict not published: %s", e)

    # the loop ---------------------------------------------------------------------------

    def sample_local(self, round_: int) -> int:
        """Sample this trainer's own rollouts for `round_` into the buffer (worker thread).

        The sampler shares the trainer's model object, so it always samples the current
        version; no weight copy is needed."""
        scfg = self.cfg.sampler
        params = sampling_params(self.cfg)  # the one builder: every sampler field, top_k too
        self.sampler.version = self.trainer.version
        was_training = self.trainer.model.training
        self.trainer.model.eval()
        try:
            samples = sample_round(self.sampler, self.trainer.tokenizer, self.tasks,
                                   self.identity.peer_id, round_,
                                   self.cfg.tasks.tasks_per_round, scfg.completions_per_task,
                                   params, style=PromptStyle.of(self.cfg.tasks))
        finally:
            self.trainer.model.train(was_training)
        self.trainer.add_local(samples)
        return len(samples)

    async def _wait_for_peers(self, stop: asyncio.Event) -> None:
        """Pace steps by the swarm: wait for `peer_batches_per_step` verified peer batches
        (at most `peer_wait_s`), verifying them as they arrive."""
        need = self.cfg.trainer.peer_batches_per_step
        deadline = asyncio.get_running_loop().time() + self.cfg.trainer.peer_wait_s
        while (self.peer_batches < need and not stop.is_set()
               and asyncio.get_running_loop().time() < deadline):
            if not len(self.queue):
                self.arrived.clear()
                try:
                    await asyncio.wait_for(self.arrived.wait(), timeout=PEER_BATCH_POLL_S)
                except TimeoutError:
                    continue
            await self._drain()

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            if self.cfg.trainer.max_steps and self.trainer.version >= self.cfg.trainer.max_steps:
                # Checked before a step, so a restart at max_steps trains nothing more.
                log.info("reached trainer.max_steps = %d at v%d; idling (serving checkpoints)",
                         self.cfg.trainer.max_steps, self.trainer.version)
                await stop.wait()
                return
            await self._drain()
            if self.cfg.trainer.sample_locally:
                await until_written(self.disk, self.work_oom_safe, self.sample_local, self.round,
                                    limit=self.sampler.batch)
                self.round += 1
                await until_written(self.disk, self.work, self.save_json, "round.json",
                                    {"next_round": self.round})
            await self._drain()
            await self._wait_for_peers(stop)
            self.peer_batches = 0
            stats = await until_written(self.disk, self.work_oom_safe, self.trainer.step,
                                        limit=self.trainer.micro_batch,
                                        on_oom=self._unclaim_failed_step)
            self.state.observe("train_step_seconds", stats.seconds)
            self.state.banned = self.reputation.banned()  # bans also expire
            self.state.buffer_counters = self.trainer.counters()
            if not stats.trained:
                await wait_any(stop, asyncio.Event(), timeout=IDLE_AFTER_EMPTY_STEP_S)
                continue
            self.state.policy_version = stats.version
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
                     "%d tokens, reward %.3f, loss %.4f, %.1f tok/s", stats.version,
                     stats.groups_local,
                     stats.groups_external, stats.tokens, reward, stats.loss,
                     stats.tokens_per_s)
            if stats.checkpoint:
                await self._publish_version()

    def _unclaim_failed_step(self) -> None:
        """After an out-of-memory step: its groups go back to the buffer (none lost)."""
        self.trainer.model.zero_grad(set_to_none=True)
        self.trainer.buffer.unclaim(self.trainer.version + 1)

    async def close(self) -> None:
        if self.own is not None:
            await self.own.close()
        await super().close()
        if self.reputation is not None:
            self.reputation.save()
        if getattr(self, "group", None) is not None:
            self.group.close()
        if self.trainer is not None:
            self.trainer.close()


def _verified_completion(c, result: RolloutResult):
    """The completion as the trainer may use it: decoded text, recomputed logprobs (NaN for
    a spot-check-skipped one: recomputed by the trainer), recomputed reward."""
    n = c.completion_ids.shape[0]
    logprobs = result.logprobs if result.logprobs is not None \
        else np.full(n, np.nan, dtype=np.float32)
    return c.model_copy(update={"text": result.text or "",
                                "logprobs": TensorData.from_numpy(
                                    np.asarray(logprobs, dtype=np.float32)),
                                "claimed_reward": float(result.reward or 0.0)})
