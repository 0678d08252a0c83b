"""The trainer's rule for its own checkpoints: each shard leaves its uplink about once, and
the swarm carries the other copies (like BitTorrent's super-seeding).

Measured before this rule (8 nodes in the simulated WAN, and 6 followers on loopback with
the trainer's uploads capped at 4 MiB/s): the trainer sent 7.2x and 4.3x the checkpoint,
because every follower, knowing nobody else held anything yet, asked the trainer first.

A trainer serves a shard of a version it published to at most `copies` askers (a copy
counts from the moment its upload starts, and is given back if the upload does not
complete); asked for it again within `hold_s` of its last copy, it answers `seeded`
(NODE_SPEC 7.2) and the asker takes the shard from a peer that holds it. After `hold_s`
without a copy, the next asker gets one more: a holder may have left or be unreachable from
the asker, so nobody waits on the trainer longer than that. Relays and followers serve
every request (their uplinks are what carries the swarm).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

MAX_VERSIONS = 4
"""Versions whose copies are counted (the newest; an older one's shards go out freely)."""


@dataclass
class _Copies:
    count: dict[int, int] = field(default_factory=dict)  # shard -> copies given
    last: dict[int, float] = field(default_factory=dict)  # shard -> when the last began


class Seeding:
    def __init__(self, origin: str, copies: int, hold_s: float, clock=time.monotonic):
        self.origin, self.copies, self.hold_s, self.clock = origin, copies, hold_s, clock
        self._versions: OrderedDict[tuple[str, int], _Copies] = OrderedDict()

    def take(self, key: tuple[str, int], shard: int) -> bool:
        """Whether to serve `shard` of `key` now (if so, it is counted as a copy)."""
        if self.copies <= 0 or key[0] != self.origin:
            return True
        c = self._versions.get(key)
        if c is None:
            c = self._versions[key] = _Copies()
            while len(self._versions) > MAX_VERSIONS:
                self._versions.popitem(last=False)
        now = self.clock()
        n = c.count.get(shard, 0)
        if n >= self.copies and now - c.last.get(shard, 0.0) < self.hold_s:
            return False
        c.count[shard] = n + 1
        c.last[shard] = now
        return True

    def give_back(self, key: tuple[str, int], shard: int) -> None:
        """A counted upload did not complete: the shard may go to the next asker."""
        c = self._versions.get(key)
        if c is not None and c.count.get(shard, 0) > 0:
            c.count[shard] -= 1
            if c.count[shard] == 0:
                c.last.pop(shard, None)

    def copies_of(self, key: tuple[str, int]) -> int:
        """Copies given of `key`'s shards so far (for the node's counters and tests)."""
        c = self._versions.get(key)
        return sum(c.count.values()) if c is not None else 0
