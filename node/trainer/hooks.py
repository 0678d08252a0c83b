"""The scale-out seams of a `Trainer`, fixed when it is built (never attached afterwards).

`grad_sync` (trainer/distributed.py `RankSync`, the other ranks of this trainer): `.shard(batch)`
-> this rank's groups, `.after_backward(model)` before clipping, `.finish(stats)`.
`after_step(trainer)` (trainer/group.py `TrainerGroup.after_step`, a trainer group): after
each trained step, before its checkpoint (parameter averaging).

A trainer takes `scale_out`, a function of the trainer being built that returns its
`StepHooks` (the group and the ranks need its model); it runs at the end of the trainer's
construction, once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StepHooks:
    grad_sync: Any = None
    after_step: Callable[[Any], None] | None = None


NO_HOOKS = StepHooks()
