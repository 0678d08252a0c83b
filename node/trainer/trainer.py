"""The trainer: buffered rollouts in, one GRPO/SAPO update per `step()`, checkpoints out.

    trainer = Trainer(config, model_dir, data_dir)
    trainer.add_local(samples)        # own sampler's rollouts (behaviour logprobs kept)
    trainer.add_external(batch)       # other policies' rollouts (re-tokenised, re-scored)
    stats = trainer.step()            # I local + J external groups -> version + 1
    trainer.latest_checkpoint()       # .policy_dir: what the sampler / broadcaster load

Staleness: a local group sampled by policy version v is dropped (counted `stale`) once
`trainer.version - v > max_staleness`; an external group is dropped once it has waited more
than `max_staleness` steps since it was accepted (other policies' versions are not
comparable with ours). A RolloutBatch whose `policy_id` is this trainer's own is local
(inference peers following our policy): its verified behaviour logprobs are used as-is.

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
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from ...protocol.messages import RolloutBatch
from ..config import Config
from ..errors import NodeError
from .buffer import CompletionRecord, RolloutBuffer, RolloutGroup
from .checkpoint import Checkpoint, CheckpointStore, rng_from_json, rng_to_json
from .grpo import LossConfig, group_advantages, has_signal, policy_loss, token_logprobs
from .mixing import Rescorer, select_groups, texts_of

log = logging.getLogger(__name__)


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
                 device: str | None = None):
        from ..models import load_model

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
                                 config.tasks.format_reward)
        self._counters = _Counters()
        self._counters_lock = threading.Lock()  # add_* may run on other threads than step()
        # Scale-out seams, None for a plain trainer. grad_sync (trainer/distributed.py):
        # .shard(batch) -> this rank's groups, .after_backward(model) before clipping,
        # .finish(stats). after_step(trainer) (trainer/group.py): after each trained step,
        # before its checkpoint (parameter averaging).
        self.grad_sync = None
        self.after_step = None
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
        log.info("trainer at version %d (%s); buffer: %d released, %d returned, %d pending",
                 self.version, latest.path, released, returned, self.buffer.count())

    # intake -------------------------------------------------------------------------------

    def add_local(self, samples) -> int:
        """Store this policy's rollouts (grouped by task); returns groups accepted.

        Rewards come from the regenerated task. Stale and zero-advantage groups are counted
        and not stored. Durable when this returns.
        """
        by_key: dict[tuple, list] = defaultdict(list)
        for s in samples:
            by_key[(s.task.model_dump_json(), int(s.policy_version))].append(s)
        groups = []
        for (_, pv), items in by_key.items():
            ref = items[0].task
            comps = [CompletionRecord(list(s.completion_ids),
                                      self.rescorer.score(ref, s.text),
                                      _as_list(s.logprobs), s.finish_reason, s.text)
                     for s in items if len(s.completion_ids) > 0]
            groups.append(RolloutGroup("local", ref.model_dump(mode="json"),
                                       list(items[0].prompt_ids), comps, self.policy_id, pv,
                                       self.version, self.temperature))
        return self._store(groups)

    def add_external(self, batch_or_samples) -> int:
        """Store other policies' rollouts (RolloutBatch or Samples) for SAPO mixing.

        Re-tokenised and re-scored here; the sender's reward is ignored. A batch of our own
        policy (policy_id == ours) counts as local, with its behaviour logprobs.
        """
        if (isinstance(batch_or_samples, RolloutBatch) and self.policy_id
                and batch_or_samples.policy_id == self.policy_id):
            return self._add_own_batch(batch_or_samples)
        texts, policy_id, policy_version, temp = texts_of(batch_or_samples)
        groups, rejected = self.rescorer.groups(texts, policy_id, policy_version,
                                                self.version, temp or self.temperature)
        if rejected:
            self.buffer.bump("rejected_external", rejected)
        return self._store(groups)

    def _add_own_batch(self, batch: RolloutBatch) -> int:
        by_task: dict[str, list] = defaultdict(list)
        for c in batch.completions:
            by_task[c.task.model_dump_json()].append(c)
        groups = []
        for items in by_task.values():
            ref = items[0].task
            comps = [CompletionRecord([int(x) for x in c.completion_ids.to_numpy()],
                                      self.rescorer.score(ref, c.text),
                                      _verified_or_none(c.logprobs),
                                      c.finish_reason, c.text)
                     for c in items if c.completion_ids.shape[0] > 0]
            groups.append(RolloutGroup("local", ref.model_dump(mode="json"),
                                       [int(x) for x in items[0].prompt_ids.to_numpy()], comps,
                                       batch.policy_id, batch.policy_version, self.version,
                                       batch.sampling.temperature))
        return self._store(groups)

    def _store(self, groups: list[RolloutGroup]) -> int:
        keep, stale = [], 0
        for g in groups:
            if g.source == "local":
                with self._counters_lock:
                    self._counters.local_rewards += g.rewards
                if self.version - g.policy_version > self.cfg.max_staleness:
                    stale += 1
                    continue
            if not has_signal(g.rewards):
                with self._counters_lock:
                    self._counters.zero_adv += 1
                continue
            keep.append(g)
        if stale:
            self.buffer.bump("dropped_stale", stale)
        if len(keep) < len(groups) - stale:
            self.buffer.bump("dropped_zero_advantage", len(groups) - stale - len(keep))
        return len(self.buffer.add(keep))

    # training -----------------------------------------------------------------------------

    def _drop_stale(self) -> tuple[list[RolloutGroup], list[RolloutGroup], int]:
        local, external, stale = [], [], []
        for g in self.buffer.pending():
            age = self.version - (g.policy_version if g.source == "local" else g.received_version)
            (stale if age > self.cfg.max_staleness else
             local if g.source == "local" else external).append(g)
        self.buffer.drop([g.id for g in stale], "stale")
        return local, external, len(stale)

    def step(self) -> StepStats:
        """One update on up to I local + J external groups; checkpoint per config."""
        t0 = time.perf_counter()
        local, external, stale = self._drop_stale()
        # freshest local groups first (closest to on-policy), then oldest arrival
        local.sort(key=lambda g: (-g.policy_version, g.id))
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
            self._update(batch, stats)
            self.version += 1
            stats.version, stats.trained = self.version, True
            if self.after_step is not None:
                self.after_step(self)
            stats.groups_local, stats.groups_external = len(chosen_local), len(chosen_ext)
            if self.version % self.cfg.checkpoint_every == 0:
                stats.checkpoint = str(self._checkpoint().policy_dir)
        stats.pending_local = self.buffer.count("local")
        stats.pending_external = self.buffer.count("external")
        stats.seconds = time.perf_counter() - t0
        return stats

    def _rows(self, batch: list[RolloutGroup]):
        rows = []  # (prompt_ids, completion_ids, behaviour logprobs | None, advantage, temp)
        for g in batch:
            adv = group_advantages(torch.tensor(g.rewards, dtype=torch.float32)).tolist()
            for c, a in zip(g.completions, adv):
                rows.append((g.prompt_ids, c.completion_ids, c.logprobs, a, g.temperature,
                             c.reward))
        return rows

    def _forward(self, model, rows):
        """Per-token logprobs, entropy and mask over completion positions [B, L-1]."""
        pad = self.tokenizer.pad_token_id
        lens = [len(p) + len(c) for p, c, *_ in rows]
        width = max(lens)
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        attn = torch.zeros((len(rows), width), dtype=torch.long)
        mask = torch.zeros((len(rows), width - 1))
        temps = torch.ones(len(rows))
        for i, (p, c, _lp, _a, temp, _r) in enumerate(rows):
            seq = list(p) + list(c)
            ids[i, :len(seq)] = torch.tensor(seq)
            attn[i, :len(seq)] = 1
            mask[i, len(p) - 1:len(seq) - 1] = 1  # logits at t predict token t+1
            temps[i] = temp if temp and temp > 0 else 1.0
        ids, attn, mask = ids.to(self.device), attn.to(self.device), mask.to(self.device)
        logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1, :]
        logits = logits / temps.to(self.device)[:, None, None]
        logp, ent = token_logprobs(logits, ids[:, 1:])
        return logp, ent, mask

    @torch.no_grad()
    def _fill_behaviour(self, rows) -> list:
        """Rows without behaviour logprobs (external text) get them from the current policy,
        once, before the first update of the step."""
        missing = [i for i, r in enumerate(rows) if r[2] is None]
        mb = self.cfg.micro_batch_size
        for start in range(0, len(missing), mb):
            idx = missing[start:start + mb]
            logp, _, _ = self._forward(self.model, [rows[i] for i in idx])
            for k, i in enumerate(idx):
                p, c = rows[i][0], rows[i][1]
                lp = logp[k, len(p) - 1:len(p) - 1 + len(c)].float().cpu().tolist()
                rows[i] = (rows[i][0], rows[i][1], lp, *rows[i][3:])
        return rows

    def _behaviour(self, rows, like: torch.Tensor) -> torch.Tensor:
        """Behaviour logprobs laid out like the policy's [B, L-1] (zeros off the mask)."""
        out = torch.zeros_like(like)
        for i, (p, c, lp, *_rest) in enumerate(rows):
            if len(lp) != len(c):
                raise NodeError("behaviour logprobs and completion differ in length")
            out[i, len(p) - 1:len(p) - 1 + len(c)] = torch.tensor(lp, device=out.device)
        return out

    def _update(self, batch: list[RolloutGroup], stats: StepStats) -> None:
        if self.grad_sync is not None:
            batch = self.grad_sync.shard(batch)
        self.model.train()
        rows = self._fill_behaviour(self._rows(batch))
        total_tokens = sum(len(r[1]) for r in rows)
        mb = self.cfg.micro_batch_size
        for _epoch in range(self.cfg.updates_per_step):
            self.optimizer.zero_grad(set_to_none=True)
            agg = defaultdict(float)
            for start in range(0, len(rows), mb):
                chunk = rows[start:start + mb]
                logp, ent, mask = self._forward(self.model, chunk)
                behaviour = self._behaviour(chunk, logp)
                ref = None
                if self.ref_model is not None:
                    with torch.no_grad():
                        ref, _, _ = self._forward(self.ref_model, chunk)
                adv = torch.tensor([r[3] for r in chunk], device=self.device)
                loss, ls = policy_loss(logp, behaviour, adv, mask, self.loss_cfg, ref, ent)
                weight = ls.tokens / max(total_tokens, 1)  # token-level mean over the batch
                (loss * weight).backward()
                for k in ("loss", "clip_low_frac", "clip_high_frac", "delta_frac",
                          "mean_ratio", "kl", "entropy"):
                    agg[k] += getattr(ls, k) * weight
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
        stats.mean_reward = _mean([r[5] for r in rows])
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


def _verified_or_none(logprobs) -> list[float] | None:
    """Behaviour logprobs of a verified own-policy batch: the trainer role hands the
    verifier's recomputed ones; NaN marks a spot-check-skipped rollout (nothing verified):
    None, so they are recomputed under the current policy before the update."""
    values = logprobs.to_numpy().astype(float)
    return values.tolist() if np.isfinite(values).all() else None


def _as_list(logprobs) -> list[float] | None:
    if logprobs is None:
        return None
    if isinstance(logprobs, torch.Tensor):
        return logprobs.detach().float().cpu().tolist()
    return [float(x) for x in logprobs]


def _mean(xs) -> float:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else float("nan")

