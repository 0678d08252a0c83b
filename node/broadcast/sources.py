"""Source selection for one download: which peer to ask for which shard.

Each source has an EMA of measured throughput (bytes/s over whole shard transfers), a count
of consecutive failures with an exponential cooldown, a count of corrupt shards, and the
shards it advertised. A shard goes to the eligible source with the best
`throughput / (1 + in_flight)`, and to the trainer (origin) only when no other eligible
source holds it and no other known-good source that holds it is merely busy or cooling
down: the trainer's uplink would otherwise carry a copy per follower (it also
hands each shard to the swarm about once and answers `seeded` after that: seeding.py). A
source that sent `max_corrupt` corrupt shards is dropped for the rest of the version.

Sources rules (an advertiser is a claim, not a source we can count on):
- Known-good sources are the trainer and peers that delivered a verified shard to this node
  before (`ProvenPeers`). Every other advertiser is on trial: one transfer at a time until
  it delivers a verified shard, and at most `trial_slots` trial transfers at once, so the
  other transfers always go to a known-good source that holds the shard (the follower never
  stalls behind unproven advertisers).
- A source on trial that errs (a corrupt shard, a malformed or unexpected answer: anything
  but the transport failures below) loses its place at once: dropped for the version. One
  that fails to serve in time or at all (`SLOW_FAILURES`: no stream, no header within
  `request_timeout_s`, no bytes for `chunk_timeout_s`, a broken stream, a trial taken back
  with no byte) cools down (`TRIAL_COOLDOWN_S`, doubling), is asked again only when no
  usable known-good source holds the shard, and is dropped at its `trial_failures`-th such
  failure: a busy, NAT'd, still-downloading or loaded honest peer often fails once, and a
  relay that dropped each such source at once was left with the trainer alone late in a
  run (measured: relay2 dropped 7-8 of its 9 sources in six of ten 12-node smoke runs).
  An advertiser that never serves costs at most `trial_failures` transfers, each bounded
  by the transfer deadlines and the trial bound, and never one a known-good source would
  take. A known-good source cools down and is dropped after `MAX_FAILS_IN_A_ROW` failures
  in a row (a relay that departed), except the trainer, which only cools down.

Reachable followers first (`origin_not_before`): a follower behind NAT does not ask the
trainer for `NAT_HEAD_START_S` after its download starts. The trainer hands each shard out
about once (seeding.py), and a copy that lands on a peer nobody can dial serves only the
peers already connected to it; measured in the simulated WAN (30 nodes, two thirds behind
NAT) the trainer then handed most shards out again after each hold and sent 6.5x the
checkpoint. Publicly reachable followers ask at once, take the first copies, and advertise
them within `advert_interval_s`; the NAT'd follower then finds them as sources.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

EMA_ALPHA = 0.3
OPTIMISTIC_BPS = 1e12  # unmeasured sources are tried first
COOLDOWN_BASE_S = 0.2
COOLDOWN_MAX_S = 5.0
BUSY_COOLDOWN_S = 0.2
MAX_FAILS_IN_A_ROW = 4
"""Failures in a row after which a known-good source other than the trainer is dropped."""
TRIAL_COOLDOWN_S = 1.0
"""A source on trial that failed to serve is not asked again for this long (doubling with
each such failure, up to COOLDOWN_MAX_S)."""
SLOW_FAILURES = frozenset({"open_failed", "timeout", "short_read", "preempted"})
"""Failures an honest source that is slow, loaded or hard to reach also has: a source on
trial is given `trial_failures` of them. Any other failure of a trial drops it at once."""
MAX_PROVEN = 4096
"""Peers remembered as having delivered verified shards."""
NAT_HEAD_START_S = 1.0
"""How long a follower behind NAT leaves the trainer's first copies to reachable followers:
a shard's request, its upload (4 MiB at 200 Mbit/s: 0.2 s), an advert round (0.5 s) and
gossip hops (20-200 ms each). Asked earlier, the trainer would answer `seeded` anyway once a
reachable follower took the shard."""


class ProvenPeers:
    """Peers that delivered a verified shard to this node (the newest MAX_PROVEN)."""

    def __init__(self, limit: int = MAX_PROVEN):
        self.limit = limit
        self._peers: OrderedDict[str, None] = OrderedDict()

    def add(self, peer: str) -> None:
        self._peers[peer] = None
        self._peers.move_to_end(peer)
        while len(self._peers) > self.limit:
            self._peers.popitem(last=False)

    def __contains__(self, peer: str) -> bool:
        return peer in self._peers

    def __len__(self) -> int:
        return len(self._peers)


@dataclass
class SourceStats:
    peer: str
    holdings: set[int] | None = field(default_factory=set)  # None: every shard
    throughput: float | None = None
    in_flight: int = 0
    fails_in_a_row: int = 0
    failures: int = 0
    corrupt: int = 0
    shards_ok: int = 0
    cooldown_until: float = 0.0
    dropped: bool = False
    drop_reason: str | None = None
    origin: bool = False
    proven: bool = False  # delivered verified shards to this node before this version
    added: float = 0.0  # when the book learnt of it (its clock)

    @property
    def good(self) -> bool:
        """Known-good: the trainer, proven before, or delivered a shard of this version."""
        return self.origin or self.proven or self.shards_ok > 0

    def has(self, shard: int) -> bool:
        return self.holdings is None or shard in self.holdings

    @property
    def retried(self) -> bool:
        """On trial and failed before: asked only when no usable known-good source is."""
        return not self.good and self.fails_in_a_row > 0

    def score(self) -> float:
        return (self.throughput or OPTIMISTIC_BPS) / (1 + self.in_flight)

    def rank(self) -> tuple[bool, float]:
        return not self.retried, self.score()


class SourceBook:
    def __init__(self, *, per_source: int, max_corrupt: int, trial_slots: int = 1,
                 trial_failures: int = 3, clock=time.monotonic):
        self.per_source = per_source
        self.max_corrupt = max_corrupt
        self.trial_slots = trial_slots
        self.trial_failures = trial_failures  # SLOW_FAILURES that drop a source on trial
        self.clock = clock
        self.sources: dict[str, SourceStats] = {}
        self.dropped = 0  # sources dropped for this version (failed trial, corrupt, gone)
        self.drops: Counter[str] = Counter()  # ... by the failure that dropped them
        # the trainer is not asked before this (clock time): a NAT'd follower's head start
        # for reachable ones (NAT_HEAD_START_S)
        self.origin_not_before = 0.0
        self.t0 = clock()  # the book's start, for `summary`'s `added_s`

    def add(self, peer: str, holdings: set[int] | None, *, origin: bool = False,
            proven: bool = False) -> None:
        """Learn (or extend) what `peer` holds; None means the complete version."""
        s = self.sources.get(peer)
        if s is None:
            s = self.sources[peer] = SourceStats(
                peer, holdings if holdings is None else set(holdings), origin=origin,
                proven=proven, added=self.clock())
        elif s.holdings is not None:
            if holdings is None:
                s.holdings = None
            else:
                s.holdings |= holdings

    def _trials(self) -> int:
        return sum(s.in_flight for s in self.sources.values() if not s.good)

    def _usable(self, s: SourceStats, now: float, exclude, trials_open: bool) -> bool:
        if s.dropped or s.peer in exclude or s.cooldown_until > now:
            return False
        if s.good:
            return s.in_flight < self.per_source
        return s.in_flight == 0 and trials_open

    def pick(self, shard: int, exclude: set[str] = frozenset(),
             held: frozenset[str] = frozenset()) -> str | None:
        """The best source for `shard` now, or None. The trainer only if no other source
        is eligible and no other known-good source holds it (one that is busy or cooling
        down is waited for). `exclude`: sources that failed it; `held`: sources that
        answered `seeded` for it lately (neither is asked). Sources on trial get a transfer only
        while fewer than `trial_slots` trials run, or when no known-good source (usable or
        cooling down, and not holding it back) holds the shard; one that failed a trial
        before only when no usable known-good source other than the trainer holds it.
        Before `origin_not_before` the trainer is waited for like a source cooling down."""
        now = self.clock()
        exclude = exclude | held if held else exclude
        trials_open = self._trials() < self.trial_slots or not any(
            s.good and not s.dropped and s.peer not in held and s.has(shard)
            for s in self.sources.values())
        best, best_rank, origin, wait = None, (False, -1.0), None, False
        for s in self.sources.values():
            if not s.has(shard) or s.dropped or s.peer in exclude:
                continue
            if not self._usable(s, now, exclude, trials_open):
                wait = wait or (s.good and not s.origin)  # busy or cooling down
            elif s.origin:
                if now < self.origin_not_before:
                    wait = True  # reachable followers take the first copies
                else:
                    origin = s.peer
            elif s.rank() > best_rank:
                best, best_rank = s.peer, s.rank()
        return best or (None if wait else origin)

    def any_usable(self) -> bool:
        """Whether some source could take a transfer now (cheap: no shard looked at)."""
        now = self.clock()
        return any(self._usable(s, now, (), True) for s in self.sources.values())

    def next_ready(self) -> float | None:
        """When the earliest cooling-down source (or the trainer, after a NAT'd follower's
        head start) may be asked again (None: none waits)."""
        now = self.clock()
        waits = [s.cooldown_until for s in self.sources.values()
                 if not s.dropped and s.cooldown_until > now]
        if self.origin_not_before > now:
            waits.append(self.origin_not_before)
        return min(waits, default=None)

    def holders(self, shard: int, exclude: set[str] = frozenset()) -> int:
        """Sources (usable now or later) that hold `shard`."""
        return sum(1 for s in self.sources.values()
                   if not s.dropped and s.peer not in exclude and s.has(shard))

    def started(self, peer: str) -> None:
        self.sources[peer].in_flight += 1

    def finished(self, peer: str) -> None:
        self.sources[peer].in_flight -= 1

    def success(self, peer: str, nbytes: int, seconds: float) -> None:
        s = self.sources[peer]
        rate = nbytes / max(seconds, 1e-6)
        s.throughput = rate if s.throughput is None else (1 - EMA_ALPHA) * s.throughput \
            + EMA_ALPHA * rate
        s.fails_in_a_row = 0
        s.shards_ok += 1

    def failure(self, peer: str, reason: str, shard: int | None = None) -> None:
        s = self.sources[peer]
        if reason == "busy":
            s.cooldown_until = self.clock() + BUSY_COOLDOWN_S
            return
        if reason == "unknown_shard" and shard is not None and s.holdings is not None:
            s.holdings.discard(shard)  # its advert was stale; not misbehaviour
            return
        s.failures += 1
        s.fails_in_a_row += 1
        if not s.good:  # on trial: it erred, or did not serve `trial_failures` times
            if reason not in SLOW_FAILURES or s.fails_in_a_row >= self.trial_failures:
                self._drop(s, reason)
                return
            s.cooldown_until = self.clock() + min(
                COOLDOWN_MAX_S, TRIAL_COOLDOWN_S * 2 ** (s.fails_in_a_row - 1))
            return
        if not s.origin and s.fails_in_a_row >= MAX_FAILS_IN_A_ROW:
            self._drop(s, reason)  # a known source that is gone
            return
        if s.throughput is not None:
            s.throughput *= 0.5
        s.cooldown_until = self.clock() + min(COOLDOWN_MAX_S,
                                              COOLDOWN_BASE_S * 2 ** (s.fails_in_a_row - 1))

    def corrupt(self, peer: str) -> None:
        """`peer` sent bytes that do not match the signed hash: penalise, maybe drop."""
        s = self.sources[peer]
        s.corrupt += 1
        s.failures += 1
        if s.throughput is not None:
            s.throughput *= 0.1
        if s.corrupt >= self.max_corrupt:
            self._drop(s, "corrupt")

    def _drop(self, s: SourceStats, reason: str) -> None:
        if not s.dropped:
            s.dropped = True
            s.drop_reason = reason
            self.dropped += 1
            self.drops[reason] += 1

    def summary(self) -> dict[str, dict]:
        return {p: {"throughput_mib_s": round((s.throughput or 0) / 2**20, 1),
                    "shards_ok": s.shards_ok, "failures": s.failures, "corrupt": s.corrupt,
                    "dropped": s.dropped, "drop_reason": s.drop_reason,
                    "good": s.good, "added_s": round(s.added - self.t0, 2)}
                for p, s in self.sources.items()}
