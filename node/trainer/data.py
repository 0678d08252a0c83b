"""Typed trainer data: rollout groups built from their two sources, and training rows.

    groups_from_samples(samples, ...)          this node's own sampler output
    groups_from_verified_batch(batch, ...)     a verified RolloutBatch of this trainer's policy
    rows_of(groups)                            -> [TrainRow], one per completion

Both constructors derive the text from the completion's token ids with this trainer's
tokenizer and the reward from that text with this trainer's task scorer, so nothing a peer
claims (text, reward) reaches training. A verified batch carries the verifier's recomputed
logprobs as its behaviour logprobs; NaN there marks a rollout that was accepted without a
check (spot checks): its logprobs are recomputed under the current policy (None).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
import torch

from ...protocol.messages import RolloutBatch, TaskRef
from .buffer import CompletionRecord, RolloutGroup
from .grpo import group_advantages

Score = Callable[[TaskRef, str], float]
Decode = Callable[[list[int]], str]


@dataclass(frozen=True)
class TrainRow:
    """One completion as the loss sees it."""

    prompt_ids: list[int]
    completion_ids: list[int]
    behaviour_logprobs: list[float] | None  # None: recompute under the current policy
    advantage: float
    temperature: float
    reward: float


def rows_of(groups: Iterable[RolloutGroup]) -> list[TrainRow]:
    rows = []
    for g in groups:
        adv = group_advantages(torch.tensor(g.rewards, dtype=torch.float32)).tolist()
        for c, a in zip(g.completions, adv):
            rows.append(TrainRow(list(g.prompt_ids), list(c.completion_ids), c.logprobs,
                                 float(a), g.temperature, c.reward))
    return rows


def _record(ref: TaskRef, ids: list[int], logprobs: list[float] | None, finish: str,
            decode: Decode, score: Score) -> CompletionRecord:
    text = decode(ids)
    return CompletionRecord(ids, float(score(ref, text)), logprobs, finish, text)


def groups_from_samples(samples, *, decode: Decode, score: Score, policy_id: str,
                        received_version: int, temperature: float) -> list[RolloutGroup]:
    """This sampler's `Sample`s, one group per (task, policy version); empty completions
    are left out. Behaviour logprobs: the sampler's own."""
    by_key: dict[tuple, list] = defaultdict(list)
    for s in samples:
        by_key[(s.task.model_dump_json(), int(s.policy_version))].append(s)
    groups = []
    for (_, version), items in by_key.items():
        ref = items[0].task
        comps = [_record(ref, list(s.completion_ids), _as_list(s.logprobs), s.finish_reason,
                         decode, score)
                 for s in items if len(s.completion_ids) > 0]
        groups.append(RolloutGroup("local", ref.model_dump(mode="json"),
                                   list(items[0].prompt_ids), comps, policy_id, version,
                                   received_version, temperature))
    return groups


def groups_from_verified_batch(batch: RolloutBatch, *, decode: Decode, score: Score,
                               received_version: int, queued: int = 0) -> list[RolloutGroup]:
    """A verified batch of this trainer's own policy, one group per task. `queued`: versions
    the trainer moved on while the batch waited in its verification queue."""
    by_task: dict[str, list] = defaultdict(list)
    for c in batch.completions:
        by_task[c.task.model_dump_json()].append(c)
    groups = []
    for items in by_task.values():
        ref = items[0].task
        comps = [_record(ref, [int(x) for x in c.completion_ids.to_numpy()],
                         verified_or_none(c.logprobs), c.finish_reason, decode, score)
                 for c in items if c.completion_ids.shape[0] > 0]
        groups.append(RolloutGroup("local", ref.model_dump(mode="json"),
                                   [int(x) for x in items[0].prompt_ids.to_numpy()], comps,
                                   batch.policy_id, batch.policy_version, received_version,
                                   batch.sampling.temperature, queued=queued))
    return groups


def verified_or_none(logprobs) -> list[float] | None:
    """Behaviour logprobs of a verified own-policy completion: the verifier's recomputed
    ones; NaN marks a spot-check-skipped rollout (nothing verified): None, so they are
    recomputed under the current policy before the update."""
    values = logprobs.to_numpy().astype(float)
    return values.tolist() if np.isfinite(values).all() else None


def _as_list(logprobs) -> list[float] | None:
    if logprobs is None:
        return None
    if isinstance(logprobs, torch.Tensor):
        return logprobs.detach().float().cpu().tolist()
    return [float(x) for x in logprobs]
