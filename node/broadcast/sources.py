"""Source selection for one download: which peer to ask for which shard.

Each source has an EMA of measured throughput (bytes/s over whole shard transfers), a count
of consecutive failures with an exponential cooldown, a count of corrupt shards, and the
shards it advertised. A shard goes to the eligible source with the best
`throughput / (1 + in_flight)`; unmeasured sources are tried first (optimistic estimate) so
that every source gets measured. The trainer (origin) has weight `ORIGIN_WEIGHT`: a shard
that a relay or another peer holds is taken from them rather than from the trainer, whose
uplink serves everyone. A source that sent `max_corrupt` corrupt shards is dropped for the
rest of the version.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

EMA_ALPHA = 0.3
OPTIMISTIC_BPS = 1e12  # unmeasured sources are tried first
COOLDOWN_BASE_S = 0.2
COOLDOWN_MAX_S = 5.0
BUSY_COOLDOWN_S = 0.2
ORIGIN_WEIGHT = 0.25


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
    bytes_ok: int = 0
    cooldown_until: float = 0.0
    dropped: bool = False
    weight: float = 1.0

    def has(self, shard: int) -> bool:
        return self.holdings is None or shard in self.holdings

    def score(self) -> float:
        return self.weight * (self.throughput or OPTIMISTIC_BPS) / (1 + self.in_flight)


class SourceBook:
    def __init__(self, *, per_source: int, max_corrupt: int, clock=time.monotonic):
        self.per_source = per_source
        self.max_corrupt = max_corrupt
        self.clock = clock
        self.sources: dict[str, SourceStats] = {}

    def add(self, peer: str, holdings: set[int] | None, *, origin: bool = False) -> None:
        """Learn (or extend) what `peer` holds; None means the complete version."""
        s = self.sources.get(peer)
        if s is None:
            s = self.sources[peer] = SourceStats(
                peer, holdings if holdings is None else set(holdings))
            s.weight = ORIGIN_WEIGHT if origin else 1.0
        elif s.holdings is not None:
            if holdings is None:
                s.holdings = None
            else:
                s.holdings |= holdings

    def pick(self, shard: int, exclude: set[str] = frozenset()) -> str | None:
        now = self.clock()
        best, best_score = None, -1.0
        for s in self.sources.values():
            if (s.dropped or s.peer in exclude or not s.has(shard)
                    or s.in_flight >= self.per_source or s.cooldown_until > now):
                continue
            if s.score() > best_score:
                best, best_score = s.peer, s.score()
        return best

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
        s.bytes_ok += nbytes

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
            s.dropped = True

    def summary(self) -> dict[str, dict]:
        return {p: {"throughput_mib_s": round((s.throughput or 0) / 2**20, 1),
                    "shards_ok": s.shards_ok, "failures": s.failures, "corrupt": s.corrupt,
                    "dropped": s.dropped} for p, s in self.sources.items()}
