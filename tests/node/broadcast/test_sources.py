"""Source selection logic (a fake clock; no I/O)."""

from swarm_node.node.broadcast.sources import SourceBook


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def book(**kw):
    clock = Clock()
    return SourceBook(per_source=kw.get("per_source", 2), max_corrupt=kw.get("max_corrupt", 1),
                      clock=clock), clock


def test_unmeasured_sources_are_tried_then_the_fastest_wins():
    b, _ = book()
    b.add("slow", None)
    b.add("fast", None)
    b.success("slow", 1_000_000, 1.0)
    assert b.pick(0) == "fast"  # not measured yet: optimistic
    b.success("fast", 10_000_000, 1.0)
    assert b.pick(0) == "fast"
    b.started("fast")
    b.started("fast")
    assert b.pick(0) == "slow"  # fast is at its per-source limit


def test_holdings_limit_choice():
    b, _ = book()
    b.add("a", {1, 2})
    b.add("b", None)
    b.success("a", 10_000_000, 1.0)
    b.success("b", 1_000, 1.0)
    assert b.pick(1) == "a" and b.pick(5) == "b"
    b.add("a", {5})
    assert b.pick(5) == "a"
    assert b.holders(7) == 1 and b.holders(7, exclude={"b"}) == 0


def test_failure_cools_down_then_recovers():
    b, clock = book()
    b.add("a", None)
    b.failure("a", "timeout")
    assert b.pick(0) is None
    clock.t += 10
    assert b.pick(0) == "a"
    b.failure("a", "busy")  # busy: short pause, not counted as a failure
    assert b.sources["a"].failures == 1


def test_corrupt_source_is_dropped():
    b, _ = book(max_corrupt=2)
    b.add("evil", None)
    b.add("good", None)
    b.corrupt("evil")
    assert not b.sources["evil"].dropped
    b.corrupt("evil")
    assert b.sources["evil"].dropped and b.pick(0) == "good"
    assert b.summary()["evil"]["corrupt"] == 2


def test_origin_is_used_only_when_nobody_else_has_the_shard():
    b, _ = book()
    b.add("trainer", None, origin=True)
    b.add("relay", {0, 1})
    assert b.pick(0) == "relay"
    assert b.pick(3) == "trainer"


def test_stale_advert_is_not_a_failure():
    b, _ = book()
    b.add("a", {1, 2})
    b.failure("a", "unknown_shard", shard=1)
    assert b.sources["a"].failures == 0 and not b.sources["a"].has(1)
