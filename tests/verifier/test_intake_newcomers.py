"""New senders' first batches at a trainer's intake (issues 27 and 30): the probation queue
is fair per sender, the probation time share rises with accepted probation work and falls
to its floor at the first bogus, over-budget or flood-evicted batch. A scripted verifier
and a simulated clock (test_intake.py's), the real queue, budgets, reputation and tests."""

from __future__ import annotations

import random
from types import SimpleNamespace

from swarm_node.verifier.intake import IntakeLimits, TimeShare, VerificationQueue

from .test_intake import Clock, Scripted, batch, make

FLOOR = IntakeLimits().probation_time_share
LOW = IntakeLimits().probation_time_share_min


async def offer(intake, sender: str, round_: int) -> None:
    await intake.offer(SimpleNamespace(sender=sender, message=batch(round_)), "conn")


async def trainer_loop(intake, clock: Clock, until, sample_s: float = 3.0,
                       step_s: float = 1.0, max_iterations: int = 200) -> int:
    """The trainer role's loop (node/roles/trainer.py) on a simulated clock: drain, lend
    newcomers' first batches, sample its own round, drain, train. Iterations until
    `until()`."""
    for i in range(max_iterations):
        if until():
            return i
        await intake.drain()
        await intake.lend_to_newcomer()
        clock.t += sample_s
        await intake.drain()
        clock.t += step_s
    raise AssertionError("never")


def test_a_senders_first_batch_goes_before_anyones_second():
    q = VerificationQueue(lambda s: False, IntakeLimits())
    for r in range(4):
        q.put("busy", r)
    q.put("new1", "a")
    q.put("new2", "b")
    order = [q.get() for _ in range(6)]
    assert order[:3] == [("busy", 0), ("new1", "a"), ("new2", "b")]
    assert order[3:] == [("busy", 1), ("busy", 2), ("busy", 3)]
    assert q.get() is None and len(q) == 0


def test_a_newcomers_only_batch_is_not_evicted_for_a_sender_with_several():
    """Full probation queue: the victim is the newest batch of the sender with the most
    queued, never the only batch of a newcomer (on the old queue: a random one)."""
    for seed in range(50):
        q = VerificationQueue(lambda s: False, IntakeLimits(max_probation=8),
                              rng=random.Random(seed))
        for r in range(4):
            q.put("busy1", ("busy1", r))
            q.put("busy2", ("busy2", r))
        assert q.put("new", ("new", 0))  # the queue is full: a busy sender's newest goes
        assert len(q) == 8 and q.dropped == {"probation_evicted": 1}
        served = [q.get() for _ in range(8)]
        assert ("new", ("new", 0)) in served
    assert q.flood_evictions == 0  # a sender with several lost one: not a flood's shape
    # more distinct senders than slots (a fresh-key flood's shape): counted as such
    q = VerificationQueue(lambda s: False, IntakeLimits(max_probation=4))
    for k in range(6):
        q.put(f"sybil{k}", k)
    assert len(q) == 4 and q.flood_evictions == 2


def test_the_share_rises_with_accepted_work_and_falls_at_once():
    clock = Clock()
    share = TimeShare(0.1, 0.5, clock, top=0.5, step=0.1)
    assert not share.raised and share.burst_s == 0.5
    for _ in range(10):
        share.rise()
    assert share.share == 0.5 and share.raised and share.burst_s == 2.5
    share.spend(3.0)  # from the floor's full bucket (0.5 s)
    clock.t += 2.0  # refills at the raised rate: 1 s
    assert share.level() == 0.5 - 3.0 + 1.0
    share.fall()
    assert share.share == FLOOR and share.burst_s == 0.5 and not share.raised
    assert share.ready_in() == 1.5 / FLOOR + 1e-3  # the debt repaid at the floor rate


async def test_honest_newcomers_first_batches_are_served_within_a_few_steps(tmp_path):
    """7 new senders (a boot of the 10-node WAN) each offer a batch that verifies (1 s of
    the worker each) to a trainer that samples its own rounds (never idle): all are
    accepted within 5 of its iterations (20 s). At a fixed 10% share (the old intake)
    it took ~65 s: 7 s of verification repaid at 0.1 s per s."""
    clock = Clock()
    v = Scripted(clock, cost=1.0)
    intake = make(tmp_path, v)
    newcomers = [f"12D3KooWnewcomer{k}" for k in range(7)]
    start = clock.t
    for k, peer in enumerate(newcomers):
        await offer(intake, peer, k)

    def all_accepted() -> bool:
        return all(peer in intake.state.by_peer and intake.state.by_peer[peer].accepted == 4
                   for peer in newcomers)

    iterations = await trainer_loop(intake, clock, all_accepted)
    assert iterations <= 5 and clock.t - start <= 20.0, (iterations, clock.t - start)
    assert intake.share.share == IntakeLimits().probation_time_share_max
    assert intake.batches["probation_lent"] >= 1


async def test_the_drain_alone_serves_newcomers_faster_than_the_floor(tmp_path):
    """Without the lent batch (a trainer between steps only drains): the raised share and
    its deeper bucket still serve 7 newcomers in under half the floor's ~65 s."""
    clock = Clock()
    v = Scripted(clock, cost=1.0)
    intake = make(tmp_path, v)
    newcomers = [f"12D3KooWnewcomer{k}" for k in range(7)]
    for k, peer in enumerate(newcomers):
        await offer(intake, peer, k)
    start = clock.t
    while len(v.calls) < 7 and clock.t - start < 200:
        await intake.drain()
        clock.t += 1.0  # a step
    assert len(v.calls) == 7 and clock.t - start <= 30.0, clock.t - start


async def test_a_bogus_flood_drops_the_share_to_the_floor_within_a_batch(tmp_path):
    """Honest newcomers raise the share; the first bogus probation batch drops it to the
    floor, no batch is lent after it, and a flood of fresh keys then gets the floor's share
    of the time (plus what the raised bucket had banked and the batch in flight)."""
    clock = Clock()
    v = Scripted(clock, cost=1.0)
    intake = make(tmp_path, v, limits=IntakeLimits(max_probation=64))
    for k in range(4):
        await offer(intake, f"12D3KooWnewcomer{k}", k)
    await trainer_loop(intake, clock, lambda: len(v.calls) == 4)
    assert intake.share.raised
    v.reason, v.cost = "proof_index_mismatch", 0.2  # a bogus batch: one group's prefill
    await offer(intake, "12D3KooWsybil", 100)
    await trainer_loop(intake, clock, lambda: len(v.calls) == 5)
    assert intake.share.share == FLOOR and not intake.newcomer_waiting()
    # the flood: 10 fresh keys per second for 60 s, a trainer that never idles
    flood_calls, start, bogus = len(v.calls), clock.t, 0
    for i in range(60):
        for k in range(10):
            bogus += 1
            await offer(intake, f"12D3KooWsybil{i}-{k}", 1000 + bogus)
        assert await intake.lend_to_newcomer() == 0  # no honest accept: nothing lent
        await intake.drain()
        clock.t += 1.0
    flood_s = (len(v.calls) - flood_calls) * 0.2
    assert intake.share.share == LOW  # below the floor once it kept failing
    assert flood_s <= FLOOR * (clock.t - start) + 2.5 + 0.2, (flood_s, clock.t - start)


async def test_flood_evictions_and_over_budget_drop_the_share(tmp_path):
    clock = Clock()
    v = Scripted(clock, cost=0.1)
    intake = make(tmp_path, v, limits=IntakeLimits(max_probation=4, probation_tokens=1,
                                                   credit_per_accepted=0.0))
    await offer(intake, "12D3KooWnewcomer", 0)
    await intake.drain()
    assert intake.share.raised
    for k in range(5):  # more distinct fresh senders than slots
        await offer(intake, f"12D3KooWsybil{k}", 10 + k)
    assert intake.queue.flood_evictions == 1 and not intake.share.raised
    while intake.queue.probation_waiting:  # the sybils' batches verify here: it rises
        await intake.drain()
        clock.t += 10.0
    assert intake.share.raised
    # a sender past its credit (1 token; its first batch overdraws it): over budget
    for r in range(2):
        await offer(intake, "12D3KooWgreedy", 100 + r)
    while intake.queue.probation_waiting:
        await intake.drain()
        clock.t += 10.0
    assert intake.state.by_peer["12D3KooWgreedy"].reasons == {"over_budget": 4}
    assert not intake.share.raised


async def test_a_newcomers_second_batch_is_not_lent_time(tmp_path):
    clock = Clock()
    v = Scripted(clock, cost=1.0)
    intake = make(tmp_path, v)
    await offer(intake, "12D3KooWfirst", 0)
    await offer(intake, "12D3KooWsecond", 1)
    assert not intake.newcomer_waiting()  # at the floor: nothing lent
    assert await intake.lend_to_newcomer() == 0
    await intake.drain()  # the bucket's 0.5 s: one batch, accepted, the share rises
    assert intake.share.raised and intake.queue.probation_waiting == 1
    assert await intake.lend_to_newcomer() == 1  # the other one's first: lent
    await offer(intake, "12D3KooWfirst", 2)
    assert not intake.newcomer_waiting() and await intake.lend_to_newcomer() == 0
    assert intake.batches["probation_lent"] == 1


async def test_a_failing_flood_gets_less_than_the_floor_and_no_idle_time(tmp_path):
    """The `verifier-flood` shape (issue 30, flood50): 50 fresh keys a second over 4
    connections, every batch bogus (50 ms of the worker each), against a trainer that
    drains between steps and, waiting for its peers, offers its idle time (`drain(idle)`,
    node/roles/trainer.py). Once `probation_hold_s` passed with nothing accepted, the share
    halves at each failing batch down to `probation_time_share_min`, and no idle time is
    lent to it while its batches fail: over 60 s the flood verifies at most the floor's
    share for 10 s at the start and after the newcomer's accepted batch, the minimum's
    otherwise and the buckets (<= 4.8 s), where the old intake gave it the floor throughout
    and every idle turn. An honest newcomer on its own connection,
    joining 30 s in, is still accepted (within 15 s; at the floor: 2.5 s), and 5 s after
    the flood the share is back at its floor."""
    lim = IntakeLimits()

    class Judge(Scripted):
        def verify(self, b, sender, spot_check=None, probe=False, as_of=None):
            self.reason = "proof_index_mismatch" if sender.startswith("sybil") else "ok"
            return super().verify(b, sender, spot_check, probe, as_of)

    clock = Clock()
    v = Judge(clock, cost=0.05)
    intake = make(tmp_path, v)
    carrier: dict[str, str] = {}
    intake.introducer = lambda sender: (carrier.get(sender, sender), "127.0.0.0/24")
    start, keys, joined, accepted_at = clock.t, 0, None, None
    for second in range(60):
        for _ in range(50):
            keys += 1
            carrier[f"sybil{keys}"] = f"carrier{keys % 4}"
            await offer(intake, f"sybil{keys}", keys)
        if second == 30:
            joined = clock.t
        if joined is not None and second % 2 == 0:
            await offer(intake, "newcomer", 10_000 + second)
        await intake.drain()  # between two steps
        for _ in range(5):  # waiting for its peers: idle
            await intake.drain(idle=True)
            clock.t += 0.1
        got = intake.state.by_peer.get("newcomer")
        if accepted_at is None and got is not None and got.accepted:
            accepted_at = clock.t
    elapsed = clock.t - start
    bogus_s = (intake.seconds["probation"] + intake.seconds["probation_lent"]
               - 0.05 * sum(1 for s, _ in v.calls if s == "newcomer"))
    # the floor for `hold_s` at the start and after the newcomer's accepted batch, the
    # minimum otherwise, the floor's bucket and the raised one (0.2: twice as deep)
    bound = (2 * lim.probation_time_share * lim.probation_hold_s
             + lim.probation_time_share_min * elapsed + 3 * lim.probation_burst_s + 0.1)
    assert bogus_s <= bound, (bogus_s, bound, intake.seconds)
    # lent: the flood's first batch (nothing had failed yet) and one after the newcomer's
    # accepted batch, each then found bogus
    assert intake.batches["probation_lent"] <= 2, intake.batches
    assert intake.share.share == lim.probation_time_share_min
    assert accepted_at is not None and accepted_at - joined <= 15.0, (accepted_at, joined)
    # the flood ends: its queued batches age out of the lane or are verified, then 5 s quiet
    while intake.queue.probation_waiting:
        intake.queue.get_probation()
    intake.share.level()
    clock.t += lim.probation_recover_s
    intake.share.level()
    assert intake.share.share == lim.probation_time_share
