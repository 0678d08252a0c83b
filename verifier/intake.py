"""Which batch to verify next: a fair queue across senders, with probation for new keys.

New identities are free, so fairness per key alone would let a flood of fresh keys take
every verification slot. Senders are split in two tiers (`is_established(sender)`, from the
reputation: accepted work and a positive score):

- established senders are served round-robin, each with a short queue of its own;
- probation senders (new or unproven keys) share ONE small queue and at most
  `probation_share` of the batches served while established work waits; when that queue
  is full a random queued batch is evicted (so no arrival order wins), and each probation
  sender may hold at most `per_sender` batches in it.

A flood of bogus batches from fresh keys therefore costs honest established peers at most
`probation_share` of the verifier's time, and the flood's own batches mostly expire in
the probation queue unverified. Each sender also has a verification budget in completion
tokens per window (`Budget`), small on probation: a sender past it is answered
`over_budget` (no penalty, not verified).
"""

from __future__ import annotations

import random
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class IntakeLimits:
    per_sender: int = 4  # queued batches per sender
    max_established: int = 256  # queued batches of established senders, in total
    max_probation: int = 16  # queued batches of probation senders, in total
    probation_share: float = 0.2  # of the batches served while established work waits
    window_s: float = 60.0  # budget window
    established_tokens: int = 200_000  # completion tokens verified per sender per window
    probation_tokens: int = 8_192  # the same for a probation sender
    max_budget_peers: int = 10_000  # senders with a budget record (LRU)


class Budget:
    """Completion tokens verified per sender per window; records are LRU-bounded."""

    def __init__(self, limits: IntakeLimits, clock: Callable[[], float] = time.monotonic):
        self.limits = limits
        self.clock = clock
        self._used: OrderedDict[str, tuple[float, int]] = OrderedDict()  # start, tokens

    def charge(self, sender: str, tokens: int, established: bool) -> bool:
        """Spend `tokens` of `sender`'s budget; False (nothing spent) when it would exceed."""
        now = self.clock()
        start, used = self._used.get(sender, (now, 0))
        if now - start >= self.limits.window_s:
            start, used = now, 0
        cap = self.limits.established_tokens if established else self.limits.probation_tokens
        if used + tokens > cap and used > 0:
            return False
        self._used[sender] = (start, used + tokens)
        self._used.move_to_end(sender)
        while len(self._used) > self.limits.max_budget_peers:
            self._used.popitem(last=False)
        return True


class VerificationQueue:
    """Fair, bounded queue of (sender, item). Not thread-safe: one event loop owns it."""

    def __init__(self, is_established: Callable[[str], bool],
                 limits: IntakeLimits | None = None, rng: random.Random | None = None):
        self.is_established = is_established
        self.limits = limits or IntakeLimits()
        self.rng = rng or random.Random()
        self._est: OrderedDict[str, deque] = OrderedDict()
        self._est_count = 0
        self._prob: list[tuple[str, object]] = []
        self._served_est = 0
        self._served_prob = 0
        self.dropped: dict[str, int] = {}

    def __len__(self) -> int:
        return self._est_count + len(self._prob)

    def _drop(self, why: str) -> None:
        self.dropped[why] = self.dropped.get(why, 0) + 1

    def put(self, sender: str, item) -> bool:
        """Queue `item`; False if it was dropped (counted in `dropped`)."""
        lim = self.limits
        if self.is_established(sender):
            q = self._est.setdefault(sender, deque())
            if len(q) >= lim.per_sender or self._est_count >= lim.max_established:
                self._drop("established_full")
                if not q:
                    del self._est[sender]
                return False
            q.append(item)
            self._est_count += 1
            return True
        if sum(1 for s, _ in self._prob if s == sender) >= lim.per_sender:
            self._drop("probation_sender_full")
            return False
        self._prob.append((sender, item))
        if len(self._prob) > lim.max_probation:
            victim = self.rng.randrange(len(self._prob))  # random: arrival order wins nothing
            self._prob[victim] = self._prob[-1]
            self._prob.pop()
            self._drop("probation_evicted")
            return victim != len(self._prob)  # False when the new item itself went
        return True

    def get(self) -> tuple[str, object] | None:
        """The next (sender, item), or None when empty."""
        take_prob = bool(self._prob) and (
            not self._est_count
            or self._served_prob < self.limits.probation_share * (self._served_est
                                                                   + self._served_prob + 1))
        if take_prob:
            self._served_prob += 1
            return self._prob.pop(0)
        if not self._est_count:
            return None
        sender, q = next(iter(self._est.items()))
        item = q.popleft()
        self._est_count -= 1
        del self._est[sender]
        if q:
            self._est[sender] = q  # back of the round
        self._served_est += 1
        return sender, item
