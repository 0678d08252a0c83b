"""Penalty scores and rate-limit buckets: the arithmetic, with a controlled clock (the
behaviour against real hosts is in test_hostile.py)."""

from __future__ import annotations

from swarm_node.node.p2p.penalties import HALF_LIFE_S, PeerPenalties, TokenBuckets
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


def test_token_buckets_burst_refill_charge_and_bound():
    clock = Clock()
    buckets = TokenBuckets(clock=clock, max_buckets=2)
    rate = TopicRate(per_s=10, burst=5)
    assert [buckets.take("a", rate) for _ in range(6)] == [True] * 5 + [False]
    assert buckets.take("b", rate)  # another key has its own bucket
    clock.t += 0.1  # one token back
    assert buckets.take("a", rate) and not buckets.take("a", rate)
    buckets.charge("b", rate, 10)  # below zero: refilled at its rate
    clock.t += 0.5
    assert not buckets.take("b", rate)
    clock.t += 0.6
    assert buckets.take("b", rate)
    buckets.take("c", rate)  # a third key: the least recently used ("a") is forgotten
    assert len(buckets) == 2
