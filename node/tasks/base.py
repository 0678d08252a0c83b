"""A task: question, ground truth and a reward function, regenerated from its `TaskRef`."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from ...protocol.messages import TaskRef


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

    def score(self, completion_text: str) -> float:
        value = float(self.scorer(completion_text))
        if not 0.0 <= value <= 1.0:  # a third-party scorer's bug must not leak out of [0, 1]
            value = 0.0 if math.isnan(value) else min(1.0, max(0.0, value))
        return value
