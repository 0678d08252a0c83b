"""State that changes while a node runs, each piece with one owner (the config never does).

`BatchLimit`: a batch size seeded by a config knob (`sampler.max_batch`,
`trainer.micro_batch_size`) that an out-of-memory retry halves (roles/base.py
`work_oom_safe`). The sampler or trainer reads `.value` once per call in its worker thread;
the role halves it on the event loop only between two calls, so a call never sees it change.
"""

from __future__ import annotations

import threading


class BatchLimit:
    """The batch size in force for one knob (`name` is the config key an operator sets)."""

    def __init__(self, name: str, value: int):
        if value < 1:
            raise ValueError(f"{name} must be at least 1, not {value}")
        self.name = name
        self._value = int(value)
        self._lock = threading.Lock()

    @property
    def value(self) -> int:
        return self._value

    def halve(self) -> int:
        """Half the current size (at least 1); returns the new size."""
        with self._lock:
            self._value = max(1, self._value // 2)
            return self._value

    def __repr__(self) -> str:
        return f"BatchLimit({self.name}={self._value})"
