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
                      trial_slots=kw.get("trial_slots", 1),
                      trial_failures=kw.get("trial_failures", 3), clock=clock), clock


def test_unmeasured_sources_are_tried_then_the_fastest_wins():
    b, _ = book()
    b.add("slow", None, proven=True)
    b.add("fast", None, proven=True)
    b.success("slow", 1_000_000, 1.0)
    assert b.pick(0) == "fast"  # not measured yet: optimistic
    b.success("fast", 10_000_000, 1.0)
    assert b.pick(0) == "fast"
    b.started("fast")
    b.started("fast")
    assert b.pick(0) == "slow"  # fast is at its per-source limit


def test_holdings_limit_choice():
    b, _ = book()
    b.add("a", {1, 2}, proven=True)
    b.add("b", None, proven=True)
    b.success("a", 10_000_000, 1.0)
    b.success("b", 1_000, 1.0)
    assert b.pick(1) == "a" and b.pick(5) == "b"
    b.add("a", {5})
    assert b.pick(5) == "a"
    assert b.holders(7) == 1 and b.holders(7, exclude={"b"}) == 0


def test_a_known_source_cools_down_then_recovers():
    b, clock = book()
    b.add("a", None, proven=True)
    b.failure("a", "timeout")
    assert b.pick(0) is None and b.next_ready() == clock.t + 0.2
    clock.t += 10
    assert b.pick(0) == "a"
    b.failure("a", "busy")  # busy: short pause, not counted as a failure
    assert b.sources["a"].failures == 1 and not b.sources["a"].dropped


def test_an_advertiser_on_trial_that_errs_loses_its_place_at_once():
    b, clock = book()
    b.add("trainer", None, origin=True)
    b.add("liar", None)
    assert b.pick(0) == "liar"  # unmeasured: tried first, once
    b.started("liar")
    b.failure("liar", "bad_header")  # not a slow peer's failure: a protocol error
    b.finished("liar")
    clock.t += 60
    assert b.sources["liar"].dropped and b.dropped == 1 and b.pick(0) == "trainer"
    assert b.drops == {"bad_header": 1} and b.summary()["liar"]["drop_reason"] == "bad_header"


def test_a_slow_advertiser_on_trial_cools_down_and_is_asked_again():
    """Issue 27: a trial source that did not serve in time (busy, loaded, NAT'd, still
    downloading) is not lost for the version at its first failure."""
    b, clock = book()
    b.add("trainer", None, origin=True)
    b.add("slow", None)
    b.started(b.pick(0))
    b.failure("slow", "timeout")
    b.finished("slow")
    assert not b.sources["slow"].dropped and b.dropped == 0
    assert b.pick(1) == "trainer" and b.next_ready() == clock.t + 1.0  # cooling down
    clock.t += 1.0
    assert b.pick(1) == "slow"  # asked again: no known-good source other than the trainer
    b.started("slow")
    b.failure("slow", "preempted")
    b.finished("slow")
    assert b.next_ready() == clock.t + 2.0  # the cooldown doubles
    clock.t += 2.0
    b.started(b.pick(1))
    b.success("slow", 1_000_000, 1.0)  # it serves after all: known-good now
    b.finished("slow")
    assert b.sources["slow"].good and not b.sources["slow"].dropped


def test_an_advertiser_on_trial_that_never_serves_is_dropped_after_its_trials():
    b, clock = book(trial_failures=3)
    b.add("trainer", None, origin=True)
    b.add("staller", None)
    for reason in ("open_failed", "timeout", "short_read"):
        assert b.pick(0) == "staller"
        b.started("staller")
        b.failure("staller", reason)
        b.finished("staller")
        clock.t += 60
    assert b.sources["staller"].dropped and b.drops == {"short_read": 1}
    assert b.pick(0) == "trainer"


def test_with_one_trial_failure_the_first_failure_drops_as_before():
    b, _ = book(trial_failures=1)
    b.add("trainer", None, origin=True)
    b.add("staller", None)
    b.failure("staller", "timeout")
    assert b.sources["staller"].dropped and b.pick(0) == "trainer"


def test_a_retried_trial_source_comes_after_every_known_good_one():
    b, clock = book(per_source=1, trial_slots=2)
    b.add("trainer", None, origin=True)
    b.add("relay", None, proven=True)
    b.add("slow", None)
    b.add("fresh", None)
    b.success("relay", 1_000, 1.0)  # measured, and slow: a fresh trial still comes first
    b.failure("slow", "timeout")
    clock.t += 10
    assert b.pick(0) == "fresh"
    b.started("fresh")
    assert b.pick(1) == "relay"  # before the retried advertiser, however slow
    b.started("relay")
    assert b.pick(2) == "slow"  # before the trainer
    b.started("slow")
    assert b.pick(3) is None  # trial slots full; the busy relay is waited for, as before


def test_trials_never_take_every_slot_from_the_known_good_sources():
    b, _ = book(per_source=8, trial_slots=2)
    b.add("trainer", None, origin=True)
    for i in range(5):
        b.add(f"sybil{i}", None)
    picks = []
    for shard in range(8):
        peer = b.pick(shard)
        b.started(peer)
        picks.append(peer)
    # one transfer per advertiser on trial, two trials at once; the rest from the trainer
    tried = [p for p in picks if p != "trainer"]
    assert len(tried) == len(set(tried)) == 2 and picks.count("trainer") == 6
    b.success(tried[0], 1_000_000, 1.0)  # delivered a verified shard: no longer on trial
    b.finished(tried[0])
    assert b.sources[tried[0]].good  # up to per_source transfers from now on
    assert b.pick(9) not in ("trainer", *tried)  # its trial slot went to the next advertiser


def test_without_a_known_good_holder_advertisers_are_tried():
    b, _ = book(trial_slots=1)
    b.add("trainer", {0}, origin=True)
    b.add("a", {5})
    b.add("b", {5})
    b.started(b.pick(5))
    assert b.pick(5) is not None  # nobody known-good holds shard 5: no slot reserved


def test_a_known_source_that_keeps_failing_is_dropped_but_never_the_trainer():
    b, clock = book()
    b.add("relay", None, proven=True)
    b.add("trainer", None, origin=True)
    for _ in range(4):
        b.failure("relay", "open_failed")
        b.failure("trainer", "open_failed")
        clock.t += 10
    assert b.sources["relay"].dropped and not b.sources["trainer"].dropped
    assert b.pick(0) == "trainer"


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
