"""SAPO mixing: turn other policies' rollouts into training groups, and pick which to use.

External completions are treated as off-policy *text* (as in the SAPO paper):
  - the task is regenerated from its `TaskRef` (the sender's question/answer are not used),
  - the prompt is re-tokenised with this trainer's tokenizer (`format_prompt`), the
    completion text is re-tokenised too (plus EOS when it ended with EOS),
  - the reward is recomputed with this trainer's reward function; the sender's
    `claimed_reward` is ignored,
  - behaviour logprobs are left empty: the trainer recomputes them under its current policy
    just before the update, so the importance ratio of an external token starts at 1.
Selection among external groups: zero-advantage groups are dropped first (they carry no
gradient), then `uniform` draws J groups uniformly without replacement (the paper), or
`variance` draws them without replacement with probability proportional to the reward
standard deviation of the group (groups the policy is most uncertain about first).
"""

from __future__ import annotations

import random
import statistics
from collections import defaultdict
from collections.abc import Iterable

from ...protocol.messages import RolloutBatch, TaskRef
from ..errors import NodeError
from ..tasks import DEFAULT_STYLE, PromptStyle, format_prompt, get_task
from .buffer import CompletionRecord, RolloutGroup
from .grpo import has_signal


class ExternalText:
    """The parts of an external completion SAPO uses (works for `Completion` and `Sample`)."""

    __slots__ = ("finish_reason", "task", "text")

    def __init__(self, task: TaskRef, text: str, finish_reason: str):
        self.task, self.text, self.finish_reason = task, text, finish_reason


def texts_of(batch_or_samples) -> tuple[list[ExternalText], str, int, float | None]:
    """(texts, policy_id, policy_version, temperature) of a RolloutBatch or a list of Samples."""
    if isinstance(batch_or_samples, RolloutBatch):
        b = batch_or_samples
        return ([ExternalText(c.task, c.text, c.finish_reason) for c in b.completions],
                b.policy_id, b.policy_version, b.sampling.temperature)
    samples = list(batch_or_samples)
    version = max((int(s.policy_version) for s in samples), default=0)
    return ([ExternalText(s.task, s.text, s.finish_reason) for s in samples], "", version, None)


class Rescorer:
    """Re-tokenises and re-scores external text with this trainer's tokenizer and rewards."""

    def __init__(self, tokenizer, max_context: int, format_reward: float = 0.0,
                 max_completion_tokens: int | None = None, style: PromptStyle = DEFAULT_STYLE):
        self.tokenizer = tokenizer
        self.max_context = max_context
        self.format_reward = format_reward
        self.style = style  # tasks.system_prompt / few_shot: prompts as every peer builds them
        self.max_completion_tokens = max_completion_tokens
        self._tasks: dict[str, tuple] = {}

    def _task(self, ref: TaskRef):
        key = ref.model_dump_json()
        hit = self._tasks.get(key)
        if hit is None:
            task = get_task(ref, self.format_reward, self.style)
            hit = (task, format_prompt(self.tokenizer, task))
            if len(self._tasks) > 4096:
                self._tasks.clear()
            self._tasks[key] = hit
        return hit

    def score(self, ref: TaskRef, text: str) -> float:
        return self._task(ref)[0].score(text)

    def groups(self, texts: Iterable[ExternalText], policy_id: str, policy_version: int,
               received_version: int, temperature: float) -> tuple[list[RolloutGroup], int]:
        """One group per task; returns (groups, completions rejected as unusable)."""
        by_task: dict[str, list[ExternalText]] = defaultdict(list)
        refs: dict[str, TaskRef] = {}
        for t in texts:
            key = t.task.model_dump_json()
            by_task[key].append(t)
            refs[key] = t.task
        groups, rejected = [], 0
        eos = self.tokenizer.eos_token_id
        for key, items in by_task.items():
            try:
                task, prompt_ids = self._task(refs[key])
            except NodeError:
                rejected += len(items)
                continue
            comps = []
            for t in items:
                ids = list(self.tokenizer.encode(t.text, add_special_tokens=False))
                if t.finish_reason == "eos":
                    ids.append(eos)
                if self.max_completion_tokens is not None:
                    ids = ids[:self.max_completion_tokens]
                if not ids or len(prompt_ids) + len(ids) > self.max_context:
                    rejected += 1
                    continue
                # the reward is ours, from the regenerated task; the sender's is ignored
                comps.append(CompletionRecord(ids, task.score(t.text), None,
                                              t.finish_reason, t.text))
            if comps:
                groups.append(RolloutGroup(
                    source="external", task=refs[key].model_dump(mode="json"),
                    prompt_ids=list(prompt_ids), completions=comps, policy_id=policy_id,
                    policy_version=policy_version, received_version=received_version,
                    temperature=temperature))
        return groups, rejected


def select_groups(groups: list[RolloutGroup], k: int, mode: str,
                  rng: random.Random) -> list[RolloutGroup]:
    """Pick up to k groups with signal: `uniform` or `variance` (weighted by reward std)."""
    candidates = [g for g in groups if has_signal(g.rewards)]
    if k <= 0 or not candidates:
        return []
    if len(candidates) <= k:
        return candidates
    if mode == "uniform":
        return rng.sample(candidates, k)
    if mode != "variance":
        raise NodeError(f"unknown external selection {mode!r} (uniform, variance)")
    weights = [statistics.pstdev(g.rewards) for g in candidates]
    chosen = []
    pool = list(zip(candidates, weights))
    for _ in range(k):
        total = sum(w for _, w in pool)
        x = rng.random() * total
        for i, (g, w) in enumerate(pool):
            x -= w
            if x <= 0 or i == len(pool) - 1:
                chosen.append(g)
                pool.pop(i)
                break
    return chosen
