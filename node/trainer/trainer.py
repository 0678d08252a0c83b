"""The trainer: buffered rollouts in, one GRPO/SAPO update per `step()`, checkpoints out.

    trainer = Trainer(config, model_dir, data_dir)
    trainer.add_local(samples)        # own sampler's rollouts (behaviour logprobs kept)
    trainer.add_external(batch, sender, as_of)  # verified peers' rollouts (re-scored)
    stats = trainer.step()            # I local + J external groups -> version + 1
    trainer.local_room()              # local groups the next step could still take
    trainer.latest_checkpoint()       # .policy_dir: what the sampler / broadcaster load
    with trainer.sampling(): ...      # the model in eval mode for this node's own sampler
    trainer.undo_failed_step()        # after a step that raised (out of memory): groups back
    trainer.drop_sender(peer)         # a condemned peer's groups no step has used yet

Staleness: a local group sampled by policy version v is dropped (counted `stale`) once
`trainer.version - v - queued > max_staleness`; an external group is dropped once it has
waited more than `max_staleness` steps since it was accepted (other policies' versions are
not comparable with ours). A RolloutBatch whose `policy_id` is this trainer's own is local
(inference peers following our policy): its verified behaviour logprobs are used as-is, and
`queued` is the versions this trainer moved on while the batch waited in its verification
queue (`as_of`: its version when the batch arrived). That wait is ours, not the sender's: the
intake judges the batch as of its arrival (up to `verifier.queue_grace` versions of wait,
verifier/checks.py) and the trainer ages it from there too, so a batch accepted through that
grace is stored and trainable like one verified the moment it arrived (its age at acceptance
is its lag at arrival, <= max_staleness). Groups dropped stale after such a wait are also
counted `dropped_stale_queued` (buffer counters: /status, /metrics).

Which local groups a step takes (I of them): peers' verified groups of our policy first,
while within max_staleness, then the freshest (`_local_order`); the role samples its own
round only while the pending local groups leave room (`local_room`). So a group a peer was
credited for is trained on, not crowded out by this trainer's own fresher samples.

Crash safety: see buffer.py; every `checkpoint_every` steps the checkpoint is written first,
then the groups its steps used are deleted from the buffer. On start the trainer resumes
from the newest checkpoint and returns groups claimed by lost steps to the buffer.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from ...protocol.messages import RolloutBatch
from ..config import Config
from ..errors import NodeError
from ..models import load_model
from ..runtime import BatchLimit
from ..tasks import PromptStyle
from .buffer import RolloutBuffer, RolloutGroup
from .checkpoint import Checkpoint, CheckpointStore, rng_from_json, rng_to_json
from .data import TrainRow, groups_from_samples, groups_from_verified_batch, rows_of
from .grpo import LossConfig, has_signal, policy_loss
from .hooks import NO_HOOKS, StepHooks
from .logprobs import completion_logprobs, fast_head_supported, pack, plain_logprobs
from .mixing import Rescorer, select_groups, texts_of

log = logging.getLogger(__name__)

# StepStats fields that are token-weighted means of the loss statistics
LOSS_KEYS = ("loss", "clip_low_frac", "clip_high_frac", "delta_frac", "mean_ratio", "kl",
             "entropy")


@dataclass
class StepStats:
    version: int                 # policy version after this step
    trained: bool                # False: nothing usable in the buffer, version unchanged
    groups_local: int = 0
    groups_external: int = 0
    completions: int = 0
    tokens: int = 0              # completion tokens trained on
    mean_reward: float = float("nan")        # mean reward of the completions trained on
    mean_reward_local_new: float = float("nan")  # mean reward of local rollouts added since the last step
    loss: float = 0.0
    clip_low_frac: float = 0.0
    clip_high_frac: float = 0.0
    delta_frac: float = 0.0
    mean_ratio: float = 1.0
    kl: float = 0.0
    entropy: float = 0.0
    grad_norm: float = 0.0
    dropped_stale: int = 0       # this step
    dropped_zero_advantage: int = 0  # since the last step (filtered on arrival)
    pending_local: int = 0
    pending_external: int = 0
    seconds: float = 0.0
    checkpoint: str | None = None
    group_ids: list[int] = field(default_factory=list)  # buffer rows this step trained on

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def as_dict(self) -> dict:
        return {**asdict(self), "tokens_per_s": self.tokens_per_s}


@dataclass
class _Counters:
    zero_adv: int = 0
    local_rewards: list[float] = field(default_factory=list)


class Trainer:
    def __init__(self, config: Config, model_dir, data_dir, *, policy_id: str = "",
                 device: str | None = None,
                 scale_out: Callable[[Trainer], StepHooks] | None = None):
        self.config = config
        self.cfg = config.trainer
        self.policy_id = policy_id
        self.temperature = config.sampler.temperature
        root = Path(data_dir).expanduser() / "trainer"
        self.buffer = RolloutBuffer(root / "buffer.sqlite")
        self.store = CheckpointStore(root / "checkpoints", keep=self.cfg.keep_checkpoints)
        device = device or config.model.device
        latest = self.store.latest()
        source = latest.policy_dir if latest is not None else model_dir
        self.model, self.tokenizer = load_model(source, dtype=config.model.dtype, device=device)
        self.model.train()
        self.device = next(self.model.parameters()).device
        self._fast_head = fast_head_supported(self.model)
        if self.cfg.gradient_checkpointing:
            self.model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False})
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=self.cfg.learning_rate,
                                           betas=(0.9, 0.99), weight_decay=self.cfg.weight_decay)
        warmup = self.cfg.warmup_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: min(1.0, (s + 1) / warmup) if warmup > 0 else 1.0)
        self.rng = random.Random(self.cfg.seed)
        self.loss_cfg = LossConfig(self.cfg.eps_low, self.cfg.eps_high, self.cfg.delta,
                                   self.cfg.kl_coef, self.cfg.entropy_coef)
        self.ref_model = None
        if self.cfg.kl_coef > 0:
            self.ref_model, _ = load_model(model_dir, dtype=config.model.dtype, device=device)
            self.ref_model.requires_grad_(False)
        self.rescorer = Rescorer(self.tokenizer, config.model.max_context,
                                 config.tasks.format_reward,
                                 style=PromptStyle.of(config.tasks))
        self._counters = _Counters()
        self._counters_lock = threading.Lock()  # add_* may run on other threads than step()
        # completions per forward/backward pass; an out-of-memory retry halves it
        self.micro_batch = BatchLimit("trainer.micro_batch_size", self.cfg.micro_batch_size)
        self._hooks = NO_HOOKS  # scale-out seams (hooks.py), set once below
        if latest is not None:
            state = self.store.restore(latest, self.optimizer, self.scheduler)
            self.version = latest.version
            if "selection_rng" in state:
                self.rng.setstate(rng_from_json(state["selection_rng"]))
        else:
            torch.manual_seed(self.cfg.seed)
            self.version = 0
            latest = self._checkpoint()
        released, returned = self.buffer.recover(self.version)
        self._last_checkpoint: Checkpoint = latest
        self._unsaved: StepStats | None = None  # a step trained, its checkpoint not written
        log.info("trainer at version %d (%s); buffer: %d released, %d returned, %d pending",
                 self.version, latest.path, released, returned, self.buffer.count())
        if scale_out is not None:
            try:
                self._hooks = scale_out(self)
            except BaseException:
                self.close()
                raise

    @property
    def grad_sync(self):
        """The other ranks of this trainer (hooks.py), or None."""
        return self._hooks.grad_sync

    @property
    def after_step(self):
        """Run after each trained step, before its checkpoint (hooks.py), or None."""
        return self._hooks.after_step

    # intake -------------------------------------------------------------------------------

    def add_local(self, samples) -> int:
        """Store this policy's rollouts (grouped by task); returns groups accepted.

        Text is decoded from the token ids and rewards come from the regenerated task. Stale
        and zero-advantage groups are counted and not stored. Durable when this returns.
        """
        return self._store(groups_from_samples(
            samples, decode=self._decode, score=self.rescorer.score,
            policy_id=self.policy_id, received_version=self.version,
            temperature=self.temperature))

    def add_external(self, batch_or_samples, sender: str = "",
                     as_of: int | None = None) -> int:
        """Store other policies' rollouts (RolloutBatch or Samples) for SAPO mixing.

        Re-tokenised and re-scored here; the sender's reward is ignored. A batch of our own
        policy (policy_id == ours) counts as local, with its behaviour logprobs. `sender`:
        the peer whose verified batch this is (`drop_sender` finds its groups by it).
        `as_of`: the policy's latest version when the batch arrived (the intake's; None:
        now); for our own policy, the versions since then are its wait in the verification
        queue, which does not count as staleness (module docstring).
        """
        if (isinstance(batch_or_samples, RolloutBatch) and self.policy_id
                and batch_or_samples.policy_id == self.policy_id):
            queued = 0 if as_of is None else max(0, self.version - int(as_of))
            groups = groups_from_verified_batch(
                batch_or_samples, decode=self._decode, score=self.rescorer.score,
                received_version=self.version, queued=queued)
        else:
            texts, policy_id, policy_version, temp = texts_of(batch_or_samples)
            groups, rejected = self.rescorer.groups(texts, policy_id, policy_version,
                                                    self.version, temp or self.temperature)
            if rejected:
                self.buffer.bump("rejected_external", rejected)
        for g in groups:
            g.sender = sender
        return self._store(groups)

    def drop_sender(self, sender: str) -> int:
        """Forget `sender`'s verified groups that no step has claimed (a sequential test
        condemned it after they were stored); returns how many."""
        return self.buffer.drop_sender(sender)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _age(self, g: RolloutGroup) -> int:
        """Steps of staleness: a local group's policy lag less its wait in our verification
        queue; an external group's steps since it was accepted (module docstring)."""
        if g.source == "local":
            return self.version - g.policy_version - g.queued
        return self.version - g.received_version

    def _store(self, groups: list[RolloutGroup]) -> int:
        keep, stale = [], []
        for g in groups:
            if g.source == "local":
                with self._counters_lock:
                    self._counters.local_rewards += g.rewards
                if self._age(g) > self.cfg.max_staleness:
                    stale.append(g)
                    continue
            if not has_signal(g.rewards):
                with self._counters_lock:
                    self._counters.zero_adv += 1
                continue
            keep.append(g)
        self._count_stale(stale)
        if len(keep) < len(groups) - len(stale):
            self.buffer.bump("dropped_zero_advantage", len(groups) - len(stale) - len(keep))
        stored = self.buffer.add(keep)
        queued = sum(1 for g in keep if g.queued and g.id in stored)
        if queued:  # what the verification queue's grace saved (vs dropped_stale_queued)
            self.buffer.bump("stored_queued", queued)
        return len(stored)

    def _count_stale(self, stale: list[RolloutGroup]) -> None:
        """Stale groups dropped before storing: `dropped_stale`, and those that waited in
        our verification queue also `dropped_stale_queued` (never silently)."""
        if stale:
            self.buffer.bump("dropped_stale", len(stale))
        if queued := self._count_queued_stale(stale):
            log.warning("%d group(s) that waited in the verification queue were stale on "
                        "arrival in the buffer: dropped", queued)

    def _count_queued_stale(self, stale: list[RolloutGroup]) -> int:
        """Bump `dropped_stale_queued` by the stale groups that waited in our verification
        queue; returns how many."""
        queued = sum(1 for g in stale if g.queued)
        if queued:
            self.buffer.bump("dropped_stale_queued", queued)
        return queued

    # training -----------------------------------------------------------------------------

    @contextmanager
    def sampling(self) -> Iterator[None]:
        """The model in eval mode while this node's own sampler uses it (it shares the
        trainer's weights, so it always samples the current version); the training mode
        it had comes back afterwards."""
        was_training = self.model.training
        self.model.eval()
        try:
            yield
        finally:
            self.model.train(was_training)

    def undo_failed_step(self) -> int:
        """After a `step()` that raised (out of memory): its gradients are freed and the
        groups it claimed are pending again (none lost); returns how many."""
        self.model.zero_grad(set_to_none=True)
        self.optimizer.zero_grad(set_to_none=True)
        return self.buffer.unclaim(self.version + 1)

    def _drop_stale(self) -> tuple[list[RolloutGroup], list[RolloutGroup], int]:
        local, external, stale = [], [], []
        for g in self.buffer.pending():
            (stale if self._age(g) > self.cfg.max_staleness else
             local if g.source == "local" else external).append(g)
        self.buffer.drop([g.id for g in stale], "stale")
        self._count_queued_stale(stale)
        return local, external, len(stale)

    def _local_order(self, g: RolloutGroup) -> tuple[bool, int, int]:
        """Which local groups a step takes first: those peers sent (verified, the sender
        credited; older than our own fresh samples, they would otherwise wait until stale
        while each round's own samples fill the I slots), then the freshest (closest to
        on-policy; the wait in our verification queue is not held against a group), then
        the oldest arrival. The own sampler can make more; a peer's group cannot be
        replaced."""
        return (not g.sender, self._age(g), g.id or 0)

    def local_room(self) -> int:
        """Local groups the next step could take beyond those already waiting (I less the
        pending local groups still within max_staleness); the role samples its own round
        only while this is above 0, so its samples do not pile up behind peers' groups."""
        fresh = sum(1 for g in self.buffer.pending("local")
                    if self._age(g) <= self.cfg.max_staleness)
        return max(0, self.cfg.local_items - fresh)

    def step(self) -> StepStats:
        """One update on up to I local + J external groups; checkpoint per config. When the
        checkpoint fails (a full disk: the caller retries), the next call writes that
        checkpoint and trains nothing: a retry never trains the version a second time."""
        t0 = time.perf_counter()
        if self._unsaved is not None:
            stats = self._unsaved
            self._save_checkpoint(stats)
            return stats
        local, external, stale = self._drop_stale()
        local.sort(key=self._local_order)
        chosen_local = local[:self.cfg.local_items]
        chosen_ext = select_groups(external, self.cfg.external_items,
                                   self.cfg.external_selection, self.rng)
        with self._counters_lock:
            counters, self._counters = self._counters, _Counters()
        new_rewards, zero_adv = counters.local_rewards, counters.zero_adv
        stats = StepStats(version=self.version, trained=False, dropped_stale=stale,
                          dropped_zero_advantage=zero_adv,
                          mean_reward_local_new=_mean(new_rewards))
        batch = chosen_local + chosen_ext
        if batch:
            stats.group_ids = [g.id for g in batch]
            self.buffer.claim(stats.group_ids, self.version + 1)
            self.update(batch, stats)
            self.version += 1
            stats.version, stats.trained = self.version, True
            if self.after_step is not None:
                self.after_step(self)
            stats.groups_local, stats.groups_external = len(chosen_local), len(chosen_ext)
            if self.version % self.cfg.checkpoint_every == 0:
                stats.seconds = time.perf_counter() - t0  # + the checkpoint's, once written
                self._unsaved = stats
                self._save_checkpoint(stats)
                return stats
        stats.pending_local = self.buffer.count("local")
        stats.pending_external = self.buffer.count("external")
        stats.seconds = time.perf_counter() - t0
        return stats

    def _save_checkpoint(self, stats: StepStats) -> None:
        """The checkpoint of the version `stats` trained (raises as `_checkpoint` does, the
        step then still unsaved); the step's figures completed once it is written."""
        t0 = time.perf_counter()
        stats.checkpoint = str(self._checkpoint().policy_dir)
        self._unsaved = None
        stats.pending_local = self.buffer.count("local")
        stats.pending_external = self.buffer.count("external")
        stats.seconds += time.perf_counter() - t0

    def _logprobs(self, model, rows: list[TrainRow]):
        """(logprobs [N], entropy [N]) of the rows' completion tokens, concatenated."""
        batch = pack(rows, self.tokenizer.pad_token_id, self.device,
                     share_prompts=self._fast_head and self.cfg.share_prompts)
        if not self._fast_head:
            return plain_logprobs(model, batch)
        return completion_logprobs(model, batch, chunk=self.cfg.logprob_chunk,
                                   bf16_autocast=self.cfg.bf16_autocast,
                                   entropy_grad=self.loss_cfg.entropy_coef > 0
                                   and model is self.model)

    @torch.no_grad()
    def _fill_behaviour(self, rows: list[TrainRow]) -> list[TrainRow]:
        """Rows without behaviour logprobs (external text, unchecked rollouts) get them from
        the current policy, once, before the first update of the step."""
        missing = [i for i, r in enumerate(rows) if r.behaviour_logprobs is None]
        mb = self.micro_batch.value
        for start in range(0, len(missing), mb):
            idx = missing[start:start + mb]
            logp, _ = self._logprobs(self.model, [rows[i] for i in idx])
            for i, lp in zip(idx, logp.float().cpu().split([len(rows[i].completion_ids)
                                                            for i in idx])):
                rows[i] = replace(rows[i], behaviour_logprobs=lp.tolist())
        return rows

    def _micro_batches(self, rows: list[TrainRow]) -> list[list[TrainRow]]:
        """A group's rows together (they share one pass over the prompt), groups of similar
        length together (less padding), `micro_batch_size` rows at a time."""
        order = sorted(rows, key=lambda r: (len(r.prompt_ids), r.prompt_ids,
                                            len(r.completion_ids)))
        mb = self.micro_batch.value
        return [order[i:i + mb] for i in range(0, len(order), mb)]

    def _micro_step(self, chunk: list[TrainRow], total_tokens: int, agg) -> None:
        logp, ent = self._logprobs(self.model, chunk)
        behaviour = torch.tensor([x for r in chunk for x in _checked(r)], device=self.device)
        ref = None
        if self.ref_model is not None:
            with torch.no_grad():
                ref = self._logprobs(self.ref_model, chunk)[0][None]
        adv = torch.tensor([r.advantage for r in chunk for _ in r.completion_ids],
                           device=self.device)
        mask = torch.ones_like(logp)
        loss, ls = policy_loss(logp[None], behaviour[None], adv[None], mask[None],
                               self.loss_cfg, ref, ent[None])
        weight = ls.tokens / max(total_tokens, 1)  # token-level mean over the batch
        (loss * weight).backward()
        for k in LOSS_KEYS:
            agg[k] += getattr(ls, k) * weight

    def update(self, batch: list[RolloutGroup], stats: StepStats) -> None:
        """The optimizer updates of one step on `batch`, its figures into `stats`; the
        version is the caller's (`step`, or a follower rank replaying the leader's step)."""
        if self.grad_sync is not None:
            batch = self.grad_sync.shard(batch)
        self.model.train()
        rows = self._fill_behaviour(rows_of(batch))
        total_tokens = sum(len(r.completion_ids) for r in rows)
        agg: dict[str, float] = defaultdict(float)
        grad_norm = torch.zeros(())
        for _epoch in range(self.cfg.updates_per_step):
            self.optimizer.zero_grad(set_to_none=True)
            agg = defaultdict(float)
            for chunk in self._micro_batches(rows):
                self._micro_step(chunk, total_tokens, agg)
            if self.grad_sync is not None:
                self.grad_sync.after_backward(self.model)
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(),
                                                       self.cfg.grad_clip)
            self.optimizer.step()
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        for k, v in agg.items():  # stats of the last update
            setattr(stats, k, float(v))
        stats.grad_norm = float(grad_norm)
        stats.tokens = total_tokens * self.cfg.updates_per_step
        stats.completions = len(rows)
        stats.mean_reward = _mean([r.reward for r in rows])
        if self.grad_sync is not None:
            self.grad_sync.finish(stats)

    # checkpoints --------------------------------------------------------------------------

    def _checkpoint(self) -> Checkpoint:
        ck = self.store.save(self.version, self.model, self.tokenizer, self.optimizer,
                             self.scheduler,
                             state={"version": self.version, "policy_id": self.policy_id,
                                    "selection_rng": rng_to_json(self.rng.getstate())})
        self.buffer.release_through(self.version)
        self._last_checkpoint = ck
        return ck

    def latest_checkpoint(self) -> Checkpoint:
        """The newest durable checkpoint; `.policy_dir` is what samplers load and the
        broadcaster publishes."""
        return self._last_checkpoint

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Current weights (for an in-process sampler: `sampler.load_weights(state, version)`)."""
        return {k: v.detach() for k, v in self.model.state_dict().items()}

    def counters(self) -> dict[str, int]:
        return self.buffer.counters()

    def close(self) -> None:
        self.buffer.close()


def _checked(row: TrainRow) -> list[float]:
    if len(row.behaviour_logprobs) != len(row.completion_ids):
        raise NodeError("behaviour logprobs and completion differ in length")
    return row.behaviour_logprobs


def _mean(xs) -> float:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else float("nan")

