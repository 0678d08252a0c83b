"""Per-peer misbehaviour scores, connection cuts with backoff, and token buckets.

Thread-safe: the libp2p thread (stream faults, rate limits, gossip rejects, yamux window
violations) and the asyncio side (the verifier's `report_misbehaviour`) both penalise.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

from ...protocol.limits import TopicRate

log = logging.getLogger(__name__)

# Points per offence. A peer is cut at CUT_AT points; scores halve every HALF_LIFE_S, so an
# honest peer's rare fault (a stale clock is not an offence) never adds up to a cut.
POINTS: dict[str, float] = {
    "stream_fault": 60.0,  # bytes that made a stream handler raise: two within a minute cut
    "window_violation": 100.0,  # ignored the yamux receive window: cut at once
    # Rate alone costs nothing (admission.py drops what is over it): an honest trainer's
    # bursts (back to back steps, a joiner's catch-up) must never get it cut.
    "malformed": 5.0, "bad_schema": 5.0, "bad_signature": 5.0, "bad_peer_id": 5.0,
    "sender_mismatch": 5.0, "too_large": 5.0, "unknown_type": 5.0, "unknown_version": 1.0,
    # A replay is not charged: an honest duplicate that outlived pubsub's seen-cache (slow
    # paths on a loaded machine) looks the same; the rate limit bounds what it costs.
    "wrong_topic": 5.0, "hash_mismatch": 10.0,
    "unserved_announce": 5.0,  # announced a payload, then did not serve it (counted per pull)
    "bogus_batch": 10.0,  # reported by the verifier (e.g. fresh-key batches failing checks)
}
CUT_AT = 100.0
HALF_LIFE_S = 60.0
FIRST_BACKOFF_S = 30.0
MAX_BACKOFF_S = 3600.0
MAX_TRACKED_PEERS = 4096


class PeerPenalties:
    """Scores per peer. `penalise` returns True when it cut the peer: `cut(peer)` is called
    once (it disconnects) and the peer is refused for a backoff that doubles per cut."""

    def __init__(self, cut: Callable[[str], None], *, cut_at: float = CUT_AT,
                 clock: Callable[[], float] = time.monotonic):
        self.cut = cut
        self.cut_at = cut_at
        self.clock = clock
        self._lock = threading.Lock()
        self._scores: OrderedDict[str, tuple[float, float]] = OrderedDict()  # score, at
        self._until: dict[str, float] = {}
        self._backoff: dict[str, float] = {}
        self.cuts = 0

    def penalise(self, peer: str, reason: str, n: int = 1) -> bool:
        points = POINTS.get(reason, 0.0) * n
        if points <= 0 or not peer or peer == "?":
            return False
        with self._lock:
            score = self._decayed(peer) + points
            self._scores[peer] = (score, self.clock())
            self._scores.move_to_end(peer)
            while len(self._scores) > MAX_TRACKED_PEERS:
                self._scores.popitem(last=False)
            if score < self.cut_at or self._refused_locked(peer):
                return False
            backoff = min(self._backoff.get(peer, FIRST_BACKOFF_S / 2) * 2, MAX_BACKOFF_S)
            self._backoff[peer] = backoff
            self._until[peer] = self.clock() + backoff
            self._scores.pop(peer, None)
            self.cuts += 1
        log.warning("cutting peer %s (last offence %s): refused for %.0fs", peer, reason,
                    backoff)
        self.cut(peer)
        return True

    def refused(self, peer: str) -> bool:
        """True while `peer` is in its backoff after a cut."""
        with self._lock:
            return self._refused_locked(peer)

    def score(self, peer: str) -> float:
        with self._lock:
            return self._decayed(peer)

    def snapshot(self) -> dict:
        with self._lock:
            now = self.clock()
            return {"cuts": self.cuts,
                    "refused": {p: round(t - now, 1) for p, t in self._until.items() if t > now}}

    def _decayed(self, peer: str) -> float:
        score, at = self._scores.get(peer, (0.0, 0.0))
        return score * 0.5 ** ((self.clock() - at) / HALF_LIFE_S) if score else 0.0

    def _refused_locked(self, peer: str) -> bool:
        until = self._until.get(peer)
        if until is None:
            return False
        if until > self.clock():
            return True
        del self._until[peer]
        return False


class TokenBuckets:
    """Token buckets keyed by anything hashable, each refilled at the TopicRate passed with
    it; the least recently used are forgotten past `max_buckets` (a forgotten key starts
    full again, so the bound costs at most one burst per eviction). Not thread-safe."""

    def __init__(self, *, clock: Callable[[], float] = time.monotonic, max_buckets: int = 16384):
        self.clock = clock
        self.max_buckets = max_buckets
        self._buckets: OrderedDict[object, list[float]] = OrderedDict()

    def _level(self, key: object, rate: TopicRate) -> list[float]:
        now = self.clock()
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = [rate.burst, now]
            while len(self._buckets) > self.max_buckets:
                self._buckets.popitem(last=False)
        else:
            self._buckets.move_to_end(key)
            bucket[0] = min(rate.burst, bucket[0] + (now - bucket[1]) * rate.per_s)
            bucket[1] = now
        return bucket

    def take(self, key: object, rate: TopicRate) -> bool:
        """One token from `key`'s bucket; False (nothing taken) if it has less than one."""
        bucket = self._level(key, rate)
        if bucket[0] < 1.0:
            return False
        bucket[0] -= 1.0
        return True

    def charge(self, key: object, rate: TopicRate, n: float) -> None:
        """Take `n` tokens whatever the level (it may go negative: refilled at its rate)."""
        self._level(key, rate)[0] -= n

    def __len__(self) -> int:
        return len(self._buckets)
