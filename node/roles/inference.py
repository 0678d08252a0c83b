"""Inference peer: follow a trainer's policy, sample rollouts on assigned tasks, gossip them.

Each round r the peer draws its tasks from (swarm id, its peer ID, r), samples G seeded
completions per task with the current policy version, attaches an activation-hash proof to
each completion and publishes one signed RolloutBatch. New policy versions arrive through
the broadcaster and are hot-loaded between rounds. The round counter is persisted, so a
restart never reuses a round (a verifier rejects replays and stale rounds).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from ...protocol.messages import RolloutBatch
from ...verifier.proof import build_proofs
from ...verifier.rules import batch_rules
from ..broadcast.follow import trainer_choice
from ..diskspace import DiskWatch, until_written
from ..sampler import make_sampler
from ..sampler.factory import sampling_params
from ..sampler.rounds import sample_round, to_batch
from ..tasks import PromptStyle, TaskSource, get_task
from .base import Role, freeze_heap, wait_any
from .interfaces import (
    BroadcastFeed,
    CheckpointFeed,
    GossipRollouts,
    RolloutSink,
    VerifiedCheckpoint,
)
from .settings import EffectiveSettings, SettingsFollower

log = logging.getLogger("swarm_node")

ROUND_FILE = "round.json"


class InferenceRole(Role):
    name = "inference"

    def __init__(self, cfg, identity, p2p, state, *, feed: CheckpointFeed | None = None,
                 sink: RolloutSink | None = None):
        super().__init__(cfg, identity, p2p, state)
        self.sampler = None
        self.tokenizer = None
        self.tasks = None
        # None: the real ones, built in start() (the feed needs the settings follower)
        self.feed = feed
        self.sink = sink if sink is not None else GossipRollouts(p2p)
        # Applied to every batch before it is published; None except in the demo's and the
        # tests' cheater (node/testing/dishonest.py).
        self.outgoing: Callable[[RolloutBatch], RolloutBatch] | None = None
        self.policy_id: str | None = cfg.node.follow[0] if cfg.node.follow else None
        self.pending: tuple[int, object] | None = None  # (version, checkpoint dir)
        self.new_version = asyncio.Event()
        self.round = int(self.load_json(ROUND_FILE, {"next_round": 0})["next_round"])
        # a round is sampled only when its counter can be persisted: a full disk pauses it
        self.disk = DiskWatch("sampling", self.data_dir)
        self._held_said: str | None = None  # the reason sampling is held, logged once
        self._hold_seen = False  # whether the round loop last found sampling held
        self._loop: asyncio.AbstractEventLoop | None = None

    def prepare(self) -> None:
        """Load the model (the base one, as `start` did) while the host joins the swarm
        (seconds to minutes, a one-time conversion too)."""
        self.begin_load("loading the model", make_sampler, self.cfg,
                        peer_id=self.identity.peer_id)

    async def start(self) -> None:
        self.tasks = TaskSource.of(self.cfg.tasks, self.cfg.node.swarm_id)
        self.settings = SettingsFollower(self.cfg)  # the trainer's settings, adopted or refused
        # the settings of the loaded checkpoint: swapped with it, handed to every round
        self.effective = self.settings.local
        self.state.extra["settings"] = self.settings.view
        self.sampler = await self.loaded()  # begun by the runner unless a test starts it
        self._loop = asyncio.get_running_loop()
        self.tokenizer = self.sampler.tokenizer
        self.state.policy_version = self.sampler.version
        if self.feed is None:
            self.feed = BroadcastFeed.create(
                self.p2p, self.cfg.broadcast, self.data_dir / "broadcast",
                follow=self.cfg.node.follow, role="inference", choice=trainer_choice(self.cfg),
                settings_check=self.check_settings)
        self.feed.listen(self._on_checkpoint)
        self.policy_id = self.feed.chosen()
        self.state.policy_id = self.policy_id or ""
        await self.feed.start()  # hands over the newest verified version stored here
        if self.pending is not None:  # a restart: sample it, not the base model
            await self._maybe_reload()
            self.new_version.clear()  # run() still waits a while for a newer announcement
        self.state.extra["disk"] = self.feed.disk.status()
        self.state.extra["sampling_disk"] = self.disk.status()
        self.track_downloads(self.feed)
        self.watch_swarm(self.feed)
        self.count_sampling(lambda: self.sampler)
        # says so if the trainer never appears (chosen: announced by the bootstrap peer)
        self.watch_followed(self.feed, lambda: self.policy_id or self.feed.chosen())
        await self.watch_verdicts()
        log.info("inference peer ready: model %s, policy version %d", self.cfg.model.name,
                 self.sampler.version)
        freeze_heap()

    def check_settings(self, settings, trainer: str = "", version: int = -1) -> str | None:
        """The feed's settings gate (`SettingsFollower.check`). When its verdict holds
        sampling (`_held`: a refused version more than trainer.max_staleness ahead) or
        releases it, the round loop is woken at once, not at the end of its version wait
        (version_wait_s, 30 s by default). A refusal that does neither (a version still
        within the staleness bound) wakes nothing: a round of the loaded version is still
        accepted, and the loop's wait for the trainer's current version goes on."""
        refusal = self.settings.check(settings, trainer, version)
        if self._loop is not None:  # (the gate may be called off the loop)
            self._loop.call_soon_threadsafe(self._wake_if_hold_changed)
        return refusal

    def _wake_if_hold_changed(self) -> None:
        if (self._held() is not None) != self._hold_seen:
            self.new_version.set()

    def _on_checkpoint(self, ckpt: VerifiedCheckpoint) -> None:
        if self.policy_id is None:  # the explicit choice (follow.py) was made meanwhile
            self.policy_id = self.feed.chosen()
        newer = self.pending is None or ckpt.version > self.pending[0]
        if ckpt.policy_id == self.policy_id and ckpt.version > self.sampler.version and newer:
            self.pending = (ckpt.version, ckpt.path)
            self.new_version.set()
        elif (ckpt.policy_id == self.policy_id and ckpt.version == self.sampler.version
              and self.pending is None):
            # the trainer's current version is the one held here (its v0: the base model):
            # the first round's wait for its announcement (run) ends now, not after
            # version_wait_s (a peer started beside a new trainer waited it out in full)
            effective = self.settings.effective_for(self.policy_id, ckpt.version)
            if (effective.adopted, effective.model_id) != (self.effective.adopted,
                                                           self.effective.model_id):
                # its manifest carried settings (a model too) adopted here: loaded like a
                # new version, so the first round samples with them, not with this node's
                # own (the trainer rejected those rounds: sampling_params)
                self.pending = (ckpt.version, ckpt.path)
            self.new_version.set()

    async def _maybe_reload(self) -> None:
        if self.pending is None:
            return
        version, ckpt_dir = self.pending
        self.pending = None
        t0 = time.monotonic()
        effective = self.settings.effective_for(self.policy_id, version)
        await self._adopt_settings(effective, ckpt_dir)
        await self.work(self.sampler.load_weights, ckpt_dir, version)
        self.effective = effective  # the next round samples with this checkpoint's settings
        self.state.observe("checkpoint_load_seconds", time.monotonic() - t0)
        self.state.policy_version = version
        self.state.policy_id = self.policy_id or ""
        log.info("hot-loaded policy version %d in %.2fs", version, time.monotonic() - t0)

    async def _adopt_settings(self, effective: EffectiveSettings, ckpt_dir) -> None:
        """What a checkpoint's settings (settings.py) change beyond the round's parameters:
        the task mix, and the base model, loaded from the checkpoint directory itself."""
        now, new = self.effective.config.tasks, effective.config.tasks
        if (now.mix, now.params) != (new.mix, new.params):
            self.tasks = TaskSource.of(new, self.cfg.node.swarm_id)
        if effective.model_id != self.effective.model_id:
            cfg = effective.config.with_overrides({"model.name": str(ckpt_dir)})
            self.sampler = await self.work(make_sampler, cfg, peer_id=self.identity.peer_id)
            self.tokenizer = self.sampler.tokenizer
            log.info("model adopted from the trainer's checkpoint %s", ckpt_dir)

    async def run(self, stop: asyncio.Event) -> None:
        # The trainer announces its current version on start and re-advertises it: wait for
        # it before the first round, so the first batch is not already stale.
        if await wait_any(stop, self.new_version, timeout=self.cfg.sampler.version_wait_s):
            self.new_version.clear()
        while not stop.is_set():
            await self._maybe_reload()
            if self.policy_id is None:
                # Nobody to follow yet: the chosen trainer's first checkpoint sets it
                # (_on_checkpoint) and wakes this wait.
                await wait_any(stop, self.new_version, timeout=None)
                self.new_version.clear()
                continue
            self.state.policy_id = self.policy_id
            held = self._held()
            self._hold_seen = held is not None  # a change from now on wakes the waits below
            if held:
                # a round now would be stale at the trainer (rejected and counted against
                # this node): wait for a checkpoint instead of sampling the old one
                why, line = held
                if why != self._held_said:  # once per reason, not per version
                    self._held_said = why
                    log.info("sampling held: %s; it resumes with the next checkpoint", line)
                self.state.extra["sampling_held"] = line
                if self.pending is None:
                    self.new_version.clear()
                await wait_any(stop, self.new_version, timeout=self.cfg.sampler.version_wait_s)
                continue
            if self._held_said is not None:
                log.info("sampling resumed with policy v%d", self.sampler.version)
                self._held_said = None
                self.state.extra.pop("sampling_held", None)
            # disk full: sampling pauses (one line; the next version could not be downloaded
            # either) and resumes when space returns
            if not await self.disk.wait_for_space(0, stop):
                break
            effective = self.effective  # one snapshot for the whole round
            round_ = self._next_round(effective)
            if round_ is None:
                # This version's rounds are used up (BatchRules: rounds are bound to the
                # version, verifiers accept no others); wait for the next version.
                self.new_version.clear()
                await wait_any(stop, self.new_version, timeout=self.cfg.sampler.version_wait_s)
                continue
            t0 = time.monotonic()
            batch = await self.work_oom_safe(self.sample_round, round_, effective,
                                             sampler=self.sampler)
            seconds = time.monotonic() - t0
            self.state.observe("sample_round_seconds", seconds)
            self.round = round_ + 1
            # the round is persisted before publishing (a write that fails for space pauses
            # here; a stop meanwhile drops this batch unsent: WaitStopped)
            await until_written(self.disk, self.work, self.save_json, ROUND_FILE,
                                {"next_round": self.round}, stop=stop)
            if self.pending is not None and (
                    self.pending[0] - batch.policy_version > self.cfg.trainer.max_staleness):
                # A much newer policy arrived while sampling: verifiers would reject this
                # batch as stale, so it is not sent.
                self.state.count("stale_batches_discarded")
                log.info("discarded round %d: sampled with v%d, v%d already here", batch.round,
                         batch.policy_version, self.pending[0])
                continue
            if held := self._held():
                # sampling was held while this round sampled (the trainer is now too far
                # ahead): the trainer would reject it as stale and count it against us
                self.state.count("stale_batches_discarded")
                log.info("discarded round %d of v%d: %s", batch.round, batch.policy_version,
                         held[1])
                continue
            try:
                await self.sink.publish(batch)
            except Exception as e:  # noqa: BLE001 - counted and logged; the next round retries
                self.state.count("publish_failed")
                log.warning("publishing round %d failed: %s", batch.round, e)
                continue
            self.state.rollouts_sent += len(batch.completions)
            rewards = [c.claimed_reward for c in batch.completions]
            self.state.reward = sum(rewards) / len(rewards)
            tokens = sum(int(c.completion_ids.shape[0]) for c in batch.completions)
            self.state.record_step(batch.policy_version, self.state.reward, round=batch.round,
                                   accuracy=sum(r >= 1.0 for r in rewards) / len(rewards),
                                   tokens_per_s=round(tokens / max(seconds, 1e-6), 1))
            log.info("published round %d: %d completions, policy v%d, mean reward %.3f",
                     batch.round, len(batch.completions), batch.policy_version, self.state.reward)

    def _held(self) -> tuple[str, str] | None:
        """Why a round of the loaded version would be stale at the followed trainer (its
        newest version is more than trainer.max_staleness ahead): its policy is refused
        here (the swarm settings differ), or that version is still downloading: (reason,
        line). None: sample."""
        lag, have = self.cfg.trainer.max_staleness, self.sampler.version
        if self.settings.refused and self.settings.refused_version - have > lag:
            return "refused", (f"the trainer's v{self.settings.refused_version} is refused "
                               f"here (its swarm settings differ: see the banner) and rounds "
                               f"of v{have} would be stale")
        p = self.state.checkpoint_progress
        if p and not p.get("complete") and p.get("version", 0) - have > lag:
            return "downloading", (f"v{p['version']} is downloading and rounds of v{have} "
                                   "would be stale")
        return None

    def _next_round(self, effective: EffectiveSettings) -> int | None:
        """The next unused round of the current version's window, or None when used up."""
        window = batch_rules(effective.config).round_window(self.sampler.version)
        round_ = max(self.round, window.start)
        return round_ if round_ in window else None

    def sample_round(self, round_: int, effective: EffectiveSettings | None = None
                     ) -> RolloutBatch:
        """Draw this round's tasks, sample, prove, and build the batch (worker thread), with
        the settings of the checkpoint being sampled (`effective`; default: the current)."""
        cfg = (effective or self.effective).config
        scfg, tcfg = cfg.sampler, cfg.tasks
        fmt, style = tcfg.format_reward, PromptStyle.of(tcfg)
        params = sampling_params(cfg)  # the one builder: every sampler field, top_k too
        samples = sample_round(self.sampler, self.tokenizer, self.tasks, self.identity.peer_id,
                               round_, tcfg.tasks_per_round, scfg.completions_per_task, params,
                               style=style)
        batch = to_batch(samples, self.cfg.node.swarm_id, self.policy_id, round_, params,
                         score=lambda ref, text: get_task(ref, fmt, style).score(text))
        proofs = build_proofs([s.hidden for s in samples])
        batch = batch.model_copy(update={"dtype": cfg.model.dtype, "completions": [
            c.model_copy(update={"proof": p}) for c, p in zip(batch.completions, proofs)]})
        if self.outgoing is not None:
            batch = self.outgoing(batch)
        return batch

    async def close(self) -> None:
        if self.feed is not None:
            await self.feed.close()
        await super().close()
