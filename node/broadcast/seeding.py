"""The trainer's rule for its own checkpoints: each shard leaves its uplink about once, and
the swarm carries the other copies (like BitTorrent's super-seeding).

Measured before any rule (8 nodes in the simulated WAN, and 6 followers on loopback with
the trainer's uploads capped at 4 MiB/s): the trainer sent 7.2x and 4.3x the checkpoint,
because every follower, knowing nobody else held anything yet, asked the trainer first.

A trainer serves a shard of a version it published to at most `copies` askers (a copy
counts from the moment its upload starts, and is given back if the upload does not
complete); later askers get `seeded` (NODE_SPEC 7.2) and take the shard from a peer that
holds it. The trainer hands the shard out once more only when the swarm stopped carrying
it: no copy of its own in flight, and an asker was answered `seeded` `hold_s` ago with no
sign of the shard spreading since. A sign is a copy of its own completing, or an advert
naming a new holder of the shard that the trainer did not give it to (so one that got it
from another peer: the holders serve it on). A holder that stalls or left, or holders
nobody can reach, show as no new holders, and the shard is released `hold_s` after the
first unanswered ask. An asker that was answered `seeded` for a shard for
`ASKER_WAIT_HOLDS * hold_s` gets a copy whatever the adverts say: it reaches no holder
(behind NAT, or its sources full of unreachable ones), or advertisers name shards they
never serve (sybil keys cost nothing; this bounds what they can hold back to that wait,
MAX_ASKER_WAIT_S once copies of the shard went out that way).

Measured first (the timer it replaces: one more copy `hold_s` after the last, whatever
the swarm did): 12 nodes in the simulated WAN, 64 MiB, the trainer gave 11 copies beyond
each shard's first, all 5-8 s after the one before, 10 of them while other holders were
uploading that very shard (one when 10 of the 11 receivers held it already); at 30 nodes
the runs take longer and it handed out 5.6 copies of the checkpoint.

Each copy released beyond `copies` makes the next one of that shard harder to get: the
hold and the asker's wait are multiplied by EXTRA_BACKOFF per such copy (up to
MAX_ASKER_WAIT_S). Measured first (30 nodes in the simulated WAN, 64 MiB, 2026-12-04):
the trainer sent 6.1x the checkpoint, 79 copies beyond the shards' first (60 waited, 19
stalled), 75 of them while other holders had uploads of that shard in the 5 s before, in
bursts (4 copies of one shard within 0.8 s: every asker whose 15 s ran out at once),
76 of them to public followers and relays (reachable by everyone). A copy given makes a
holder that serves on; the next one of that shard waits for it. With the backoff, two runs
of the same: 2.35x and 1.95x (20 and 13 extra copies), the time unchanged (64-71 s).

Relays and followers serve every request (their uplinks are what carries the swarm).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

from ...protocol.messages import ShardAdvert

MAX_VERSIONS = 4
"""Versions whose copies are counted (the newest; an older one's shards go out freely)."""
MAX_PEERS = 1024
"""Advertisers (per version) whose holdings are remembered, as one bit per shard (at most
2 KiB each for 16384 shards: 2 MiB per version); one forgotten and heard again counts as a
new holder of its shards once (their asks wait `hold_s` more, no more)."""
MAX_WAITING = 65536
"""(asker, shard) pairs whose first `seeded` answer is remembered (per version); a
forgotten one waits its `ASKER_WAIT_HOLDS` again."""
ASKER_WAIT_HOLDS = 3.0
"""An asker answered `seeded` for a shard this many `hold_s` ago (15 s by default) gets a
copy: a follower that asks the trainer knows no usable holder of the shard."""
EXTRA_BACKOFF = 4.0
"""Per copy of a shard already released beyond `copies`, its hold and the asker's wait are
this many times longer (15 s, 60 s, then MAX_ASKER_WAIT_S for the asker by default)."""
MAX_ASKER_WAIT_S = 120.0
"""The longest an asker waits for its copy (unless ASKER_WAIT_HOLDS holds are longer):
what advertisers that never serve can hold a follower back at most."""


@dataclass
class _Copies:
    count: dict[int, int] = field(default_factory=dict)  # shard -> copies given
    flying: dict[int, int] = field(default_factory=dict)  # shard -> uploads in flight
    to: dict[int, set[str]] = field(default_factory=dict)  # shard -> peers given a copy
    # shard -> the first `seeded` answer since the last sign that the shard spreads
    asked: dict[int, float] = field(default_factory=dict)
    heard: OrderedDict[str, int] = field(default_factory=OrderedDict)  # peer -> shard bits
    waiting: OrderedDict[tuple[str, int], float] = field(default_factory=OrderedDict)
    extra: dict[int, int] = field(default_factory=dict)  # shard -> copies released beyond


class Seeding:
    def __init__(self, origin: str, copies: int, hold_s: float, clock=time.monotonic):
        self.origin, self.copies, self.hold_s, self.clock = origin, copies, hold_s, clock
        self._versions: OrderedDict[tuple[str, int], _Copies] = OrderedDict()
        self.released: dict[str, int] = {"stalled": 0, "waited": 0}  # copies beyond the first

    def _version(self, key: tuple[str, int]) -> _Copies:
        c = self._versions.get(key)
        if c is None:
            c = self._versions[key] = _Copies()
            while len(self._versions) > MAX_VERSIONS:
                self._versions.popitem(last=False)
        return c

    def take(self, key: tuple[str, int], shard: int, peer: str = "") -> bool:
        """Whether to serve `shard` of `key` to `peer` now (if so, it is counted as a copy
        until `delivered` or `give_back`)."""
        if self.copies <= 0 or key[0] != self.origin:
            return True
        c = self._version(key)
        now = self.clock()
        if c.count.get(shard, 0) >= self.copies:
            why = self._release(c, shard, peer, now)
            if why is None:
                c.waiting.setdefault((peer, shard), now)
                while len(c.waiting) > MAX_WAITING:
                    c.waiting.popitem(last=False)
                return False
            self.released[why] += 1
            c.extra[shard] = c.extra.get(shard, 0) + 1
        c.waiting.pop((peer, shard), None)
        c.asked.pop(shard, None)
        c.count[shard] = c.count.get(shard, 0) + 1
        c.flying[shard] = c.flying.get(shard, 0) + 1
        c.to.setdefault(shard, set()).add(peer)
        return True

    def _release(self, c: _Copies, shard: int, peer: str, now: float) -> str | None:
        """Why one more copy of `shard` goes out now ("stalled": the swarm stopped
        carrying it; "waited": this asker waited long enough), or None."""
        scale = EXTRA_BACKOFF ** c.extra.get(shard, 0)
        base = ASKER_WAIT_HOLDS * self.hold_s
        wait = min(base * scale, max(base, MAX_ASKER_WAIT_S))
        first = c.waiting.get((peer, shard))
        if first is not None and now - first >= wait:
            return "waited"
        asked = c.asked.setdefault(shard, now)
        if c.flying.get(shard, 0) == 0 and now - asked >= min(self.hold_s * scale, wait):
            return "stalled"
        return None

    def delivered(self, key: tuple[str, int], shard: int) -> None:
        """A counted upload completed: a new holder, so asks wait for the swarm again."""
        c = self._versions.get(key)
        if c is not None and c.flying.get(shard, 0) > 0:
            c.flying[shard] -= 1
            c.asked.pop(shard, None)

    def give_back(self, key: tuple[str, int], shard: int) -> None:
        """A counted upload did not complete: the shard may go to the next asker."""
        c = self._versions.get(key)
        if c is not None and c.count.get(shard, 0) > 0:
            c.count[shard] -= 1
            c.flying[shard] = max(0, c.flying.get(shard, 0) - 1)
            # an extra copy that made no holder does not lengthen the next one's wait
            c.extra[shard] = max(0, min(c.extra.get(shard, 0), c.count[shard] - self.copies))

    def heard(self, peer: str, advert: ShardAdvert, num_shards: int) -> None:
        """`peer` advertised holdings of one of our versions: the shards it names for the
        first time, and that we did not give it, reached it through the swarm: asks for them
        wait for the swarm again."""
        c = self._versions.get((advert.policy_id, advert.version))
        if c is None or peer == self.origin:
            return
        full = (1 << num_shards) - 1
        bits = full if advert.complete else int.from_bytes(advert.have, "little") & full
        old = c.heard.pop(peer, 0)
        c.heard[peer] = bits | old
        while len(c.heard) > MAX_PEERS:
            c.heard.popitem(last=False)
        new = bits & ~old
        while new:
            low = new & -new
            shard = low.bit_length() - 1
            new ^= low
            if peer not in c.to.get(shard, ()):
                c.asked.pop(shard, None)

    def unanswered(self, key: tuple[str, int]) -> int:
        """Shards of `key` answered `seeded` with no sign of spreading since (tests)."""
        c = self._versions.get(key)
        return len(c.asked) if c is not None else 0

    def copies_of(self, key: tuple[str, int]) -> int:
        """Copies given of `key`'s shards so far (for the node's counters and tests)."""
        c = self._versions.get(key)
        return sum(c.count.values()) if c is not None else 0
