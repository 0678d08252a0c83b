"""A task: question, ground truth and a reward function, regenerated from its `TaskRef`."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from ...protocol.messages import TaskRef


@dataclass(frozen=True)
class PromptStyle:
    """How every node builds a task's prompt (swarm settings tasks.system_prompt and
    tasks.few_shot): the reasoning-gym system prompt's name, and how many worked examples of
    the same generator come first as earlier chat turns (rg tasks only)."""

    system: str = "default"
    few_shot: int = 0

    @classmethod
    def of(cls, tasks_section) -> PromptStyle:
        return cls(tasks_section.system_prompt, tasks_section.few_shot)


DEFAULT_STYLE = PromptStyle()


@dataclass(frozen=True)
class Task:
    """`score(text)` is the reward in [0, 1] of a completion's decoded text; the ground truth
    in the task's answer format (`reference_completion`) scores 1.0."""

    ref: TaskRef
    prompt: str
    answer: str
    system: str | None = None
    scorer: Callable[[str], float] = field(repr=False, compare=False, default=lambda _: 0.0)
    reference_completion: str = ""
    examples: tuple[tuple[str, str], ...] = ()  # (question, answer text) turns before prompt

    def score(self, completion_text: str) -> float:
        value = float(self.scorer(completion_text))
        if not 0.0 <= value <= 1.0:  # a third-party scorer's bug must not leak out of [0, 1]
            value = 0.0 if math.isnan(value) else min(1.0, max(0.0, value))
        return value
