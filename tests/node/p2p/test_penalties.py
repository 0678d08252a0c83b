"""Penalty scores and rate-limit buckets: the arithmetic, with a controlled clock (the
behaviour against real hosts is in test_hostile.py)."""

from __future__ import annotations

from swarm_node.node.p2p.penalties import HALF_LIFE_S, PeerPenalties, TopicRateLimiter
from swarm_node.protocol.limits import TopicRate


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_scores_decay_cut_once_and_back_off_doubling():
    clock, cut = Clock(), []
    pen = PeerPenalties(cut.append, clock=clock)
    assert not pen.penalise("p", "stream_fault")  # 60
    clock.t += 2 * HALF_LIFE_S  # decays to 15
    assert not pen.penalise("p", "stream_fault")  # 75: still below 100
    assert pen.penalise("p", "stream_fault") and cut == ["p"]
    assert pen.refused("p") and not pen.penalise("p", "window_violation")  # already cut
    clock.t += 31
    assert not pen.refused("p")  # first backoff: 30 s
    assert pen.penalise("p", "window_violation") and cut == ["p", "p"]
    clock.t += 31
    assert pen.refused("p")  # second backoff: 60 s
    assert not pen.penalise("q", "stale") and pen.score("q") == 0  # never an offence


def test_rate_limiter_burst_then_refill_per_peer_and_topic():
    clock = Clock()
    lim = TopicRateLimiter({"verdicts": TopicRate(per_s=10, burst=5)}, clock=clock)
    t = "/swarm-node/s/verdicts/1"
    assert [lim.allow("a", t) for _ in range(6)] == [True] * 5 + [False]
    assert lim.allow("b", t)  # another peer has its own bucket
    clock.t += 0.1  # one token back
    assert lim.allow("a", t) and not lim.allow("a", t)
    assert [lim.allow("a", "/other/topic") for _ in range(21)].count(False) == 1  # default
