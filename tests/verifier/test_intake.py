"""The intake service (verifier/intake.py) on its own: a scripted verifier in place of the
model checks, the real reputation, queue, budgets and sequential tests, a sink that records
what the trainer would get. Issue 30 findings 4, 6, 9, 10 and 11 (the numbers below); the
real verifier and trainer behind it: test_flood.py, test_rules.py and tests/integration."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from swarm_node.node.diskspace import DiskWatch
from swarm_node.node.metrics import NodeState
from swarm_node.protocol.messages import RolloutBatch, SamplingParams, Verdict
from swarm_node.verifier.checks import RolloutResult, rollout_id
from swarm_node.verifier.intake import Budget, Intake, IntakeLimits, TimeShare
from swarm_node.verifier.reputation import Reputation
from swarm_node.verifier.sequential import PeerMonitor, SequentialSettings

from ..protocol.examples import completion
from ..waiting import async_wait_until

OWN = "12D3KooWtrainerOwnPolicy"
HONEST = "12D3KooWestablishedHonest"
STEER = {"lp_n": 0.0, "wide_ties": 1.0, "wide_flips": 1.0}  # one flipped wide tie


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class Scripted:
    """Every completion gets `reason` (accepted when "ok"/"unchecked") and `stats`; each call
    advances `clock` by `cost` seconds (the verification's time)."""

    def __init__(self, clock: Clock, reason: str = "ok", stats: dict | None = None,
                 cost: float = 0.0):
        self.clock, self.reason, self.stats, self.cost = clock, reason, stats or {}, cost
        self.calls: list[tuple[str, bool]] = []

    version = 0  # the policy's latest version here

    def latest_version(self) -> int:
        return self.version

    def verify(self, batch, sender, spot_check=None, probe=False,
               as_of=None) -> list[RolloutResult]:
        self.calls.append((sender, probe))
        self.clock.t += self.cost
        ok = self.reason in ("ok", "unchecked")
        return [RolloutResult(i, rollout_id(batch, c), ok, self.reason, stats=dict(self.stats),
                              reward=0.5 if ok else None, text="t" if ok else None)
                for i, c in enumerate(batch.completions)]


class Sink:
    def __init__(self):
        self.stored: list[tuple[str, int]] = []  # (sender, completions)
        self.dropped: list[str] = []

    def add_external(self, batch, sender: str = "", as_of=None) -> int:
        self.stored.append((sender, len(batch.completions)))
        return 1

    def drop_sender(self, sender: str) -> int:
        self.dropped.append(sender)
        return sum(1 for s, _ in self.stored if s == sender)


def batch(round_: int = 0, n: int = 4) -> RolloutBatch:
    return RolloutBatch(swarm_id="unit", round=round_, policy_id=OWN, policy_version=0,
                        sampling=SamplingParams(),
                        completions=[completion(3, seed=round_ * 100 + s) for s in range(n)])


async def inline(fn, *args):
    return fn(*args)


def make(tmp_path, verifier, *, limits=None, settings=None, clock=None, reputation=None):
    clock = clock or verifier.clock
    published: list[Verdict] = []
    reports: list[tuple[str, str]] = []

    async def publish(v):
        published.append(v)

    intake = Intake(OWN, reputation or Reputation(None), lambda policy: verifier, Sink(),
                    NodeState(OWN, "trainer", "unit"), publish=publish, work=inline,
                    disk=DiskWatch("test", tmp_path),
                    monitor=PeerMonitor(settings or SequentialSettings.for_dtype("float32")),
                    limits=limits, report=lambda peer, n, why: reports.append((peer, why)),
                    clock=clock)
    intake.published, intake.reports = published, reports
    return intake


async def send(intake, sender: str, b: RolloutBatch, origin: str = "conn") -> None:
    await intake.offer(SimpleNamespace(sender=sender, message=b), origin)
    await intake.drain()


def establish(rep: Reputation, peer: str, accepted: int = 12) -> None:
    for _ in range(accepted):
        rep.record(peer, True)
    assert rep.established(peer)


# 9, 10: consequences come before training and cost more than a batch earns ----------------


async def test_9_an_alarmed_batch_never_reaches_the_trainer(tmp_path):
    clock = Clock()
    v = Scripted(clock)
    intake = make(tmp_path, v)
    await send(intake, "12D3KooWnewcomer", batch(0))  # honest-looking: stored
    assert intake.sink.stored == [("12D3KooWnewcomer", 4)]
    v.stats = STEER  # fp32: one flipped wide tie alarms
    await send(intake, "12D3KooWnewcomer", batch(1))
    assert intake.sink.stored == [("12D3KooWnewcomer", 4)]  # the alarmed batch: not stored
    # and what it had stored before waits no longer for a step
    assert intake.sink.dropped == ["12D3KooWnewcomer"]
    peer = intake.state.by_peer["12D3KooWnewcomer"]
    assert peer.reasons["tie_steering"] == 4 and peer.accepted == 4
    assert any(p.reason == "tie_steering" and p.subject == "12D3KooWnewcomer"
               for p in intake.published)


async def test_10_an_alarm_costs_more_than_the_batch_could_earn(tmp_path):
    clock = Clock()
    rep = Reputation(None)
    establish(rep, HONEST, accepted=20)
    intake = make(tmp_path, Scripted(clock, stats=STEER), reputation=rep)
    before = rep.score(HONEST)
    await send(intake, HONEST, batch(0, n=8))  # an 8-completion batch that alarms
    assert rep.score(HONEST) <= before - 20 + 1e-6  # nothing earned, the cap lost
    assert not rep.is_banned(HONEST) and not rep.established(HONEST)  # probation again
    assert intake.sink.stored == []
    # a sender with a short history (or none) is banned by its first alarm
    fresh = make(tmp_path, Scripted(clock), reputation=rep)
    await send(fresh, "12D3KooWsybil", batch(0, n=8))
    fresh.verifier_for = lambda policy: Scripted(clock, stats=STEER)
    await send(fresh, "12D3KooWsybil", batch(1, n=8))
    assert rep.is_banned("12D3KooWsybil")


async def test_10_a_caught_steerer_does_not_buy_its_standing_back(tmp_path):
    """After its alarm, one honest batch used to make a steerer established again (16
    accepted before the alarm, score > 0), so each later alarm cost it a penalty, not a
    ban. Now only work accepted after the alarm counts, 4x more of it: the honest batch
    leaves it on probation, and its next steered batch bans it, nothing of it stored."""
    clock = Clock()
    rep = Reputation(None)
    establish(rep, "12D3KooWsteerer", accepted=16)
    v = Scripted(clock, stats=STEER)
    intake = make(tmp_path, v, reputation=rep)
    await send(intake, "12D3KooWsteerer", batch(0, n=8))  # alarm: probation again
    assert not rep.is_banned("12D3KooWsteerer") and intake.sink.stored == []
    v.stats = {}
    await send(intake, "12D3KooWsteerer", batch(1, n=8))  # honest: accepted, not enough
    assert intake.sink.stored == [("12D3KooWsteerer", 8)]
    assert rep.score("12D3KooWsteerer") > 0 and not intake.established("12D3KooWsteerer")
    v.stats = STEER
    await send(intake, "12D3KooWsteerer", batch(2, n=8))
    assert rep.is_banned("12D3KooWsteerer")
    assert intake.sink.stored == [("12D3KooWsteerer", 8)]


async def test_10_a_restart_keeps_a_caught_steerers_head_start(tmp_path):
    """The condemned peer's head start (its tests restart at 0.6 h and stay above that
    until its probation is served) lived only in the trainer's memory: after a restart a
    caught steerer faced tests from 0 again. It is derived from the persisted reputation
    now. bf16: a batch with 6 steered wide ties (LLR 9.7) alarms nobody from 0 (h 15,
    one batch 11), but does from the head start (9)."""
    bf16 = SequentialSettings.for_dtype("bfloat16")
    weak = {"lp_n": 0.0, "wide_ties": 6.0, "wide_flips": 6.0}
    clock = Clock()
    path = tmp_path / "reputation.json"
    rep = Reputation(path)
    establish(rep, "12D3KooWsteerer", accepted=16)
    caught = make(tmp_path, Scripted(clock, stats={"wide_ties": 20.0, "wide_flips": 20.0}),
                  reputation=rep, settings=bf16)
    await send(caught, "12D3KooWsteerer", batch(0, n=1))  # an alarm: probation again
    assert rep.peers["12D3KooWsteerer"].alarms == 1 and not rep.is_banned("12D3KooWsteerer")
    caught.close()
    # the trainer restarts: its reputation from disk, its sequential tests new
    rep = Reputation(path)
    restarted = make(tmp_path, Scripted(clock, stats=weak), reputation=rep, settings=bf16)
    await send(restarted, "12D3KooWsteerer", batch(1, n=1))
    assert restarted.batches["alarm_peer"] == 1  # its own tests, from the head start
    assert rep.is_banned("12D3KooWsteerer")  # its next alarm, on probation: banned
    assert restarted.sink.stored == []
    # control: the same batch from a sender without an alarm on record alarms nobody
    control = make(tmp_path, Scripted(clock, stats=weak), settings=bf16)
    await send(control, "12D3KooWnewcomer", batch(0, n=1))
    assert control.sink.stored == [("12D3KooWnewcomer", 1)]
    assert not [k for k in control.batches if k.startswith("alarm")]


# 11: a fresh key's verdict does not demote an established peer ------------------------------


async def test_11_a_verdict_from_a_fresh_key_changes_nothing(tmp_path):
    clock = Clock()
    rep = Reputation(None, spot_check_fraction=0.5, new_peer_verdicts=0, trust_score=0)
    establish(rep, HONEST)
    establish(rep, "12D3KooWotherEstablished")
    intake = make(tmp_path, Scripted(clock), reputation=rep)
    reject = Verdict(rollout_id=b"\x01" * 32, subject=HONEST, accept=False, reason="proof_bias")
    for i in range(50):
        await intake.hint(SimpleNamespace(sender=f"12D3KooWfresh{i}", message=reject), "c")
    assert rep.check_fraction(HONEST) == 0.5 and intake.established(HONEST)
    assert not rep.suspects
    # a peer with verified history here: the subject is verified in full for a while, and
    # still served first (established)
    await intake.hint(SimpleNamespace(sender="12D3KooWotherEstablished", message=reject), "c")
    assert rep.check_fraction(HONEST) == 1.0 and intake.established(HONEST)
    assert rep.score(HONEST) == pytest.approx(12.0, abs=0.1) and not rep.is_banned(HONEST)


# 6: a replay of an accepted batch is not the sender's doing ---------------------------------


async def test_6_the_same_batch_again_is_not_judged(tmp_path):
    clock = Clock()
    intake = make(tmp_path, Scripted(clock, reason="already_accepted"))
    credit = intake.budget.credit("12D3KooWvictim")
    await send(intake, "12D3KooWvictim", batch(3))
    assert "12D3KooWvictim" not in intake.state.by_peer  # neither accepted nor rejected
    assert intake.published == [] and intake.reputation.score("12D3KooWvictim") == 0.0
    assert intake.budget.credit("12D3KooWvictim") == credit  # its budget is not charged
    assert intake.state.counters["batches_already_accepted"] == 1


# 4: budgets bind the work, not the identity ---------------------------------------------------


def test_4_probation_credit_grows_with_accepted_work_not_with_time():
    clock = Clock()
    budget = Budget(IntakeLimits(probation_tokens=100, credit_per_accepted=2.0), clock)
    assert budget.charge("new", 60, established=False)
    assert budget.charge("new", 60, established=False)  # one batch may overdraw
    assert not budget.charge("new", 1, established=False)
    clock.t += 1e6  # time alone gives nothing back
    assert not budget.charge("new", 1, established=False)
    budget.earn("new", 30)  # 30 accepted tokens: +60 credit
    assert budget.charge("new", 10, established=False)
    # established senders: a rate per window
    assert budget.charge("old", 150_000, established=True)
    assert not budget.charge("old", 60_000, established=True)
    clock.t += IntakeLimits().window_s
    assert budget.charge("old", 60_000, established=True)


async def test_4_probation_senders_together_get_a_bounded_share_of_time(tmp_path):
    """Any number of fresh keys: probation verification takes at most the time share of
    the intake's wall time (plus the burst); established work is served throughout."""
    clock = Clock()
    v = Scripted(clock, reason="proof_index_mismatch", cost=1.0)  # each bogus batch: 1 s
    limits = IntakeLimits(probation_time_share=0.1, probation_burst_s=3.0, max_probation=64,
                          probation_time_share_min=0.1)  # the floor held (no halving)
    intake = make(tmp_path, v, limits=limits)
    start = clock.t
    for i in range(200):  # a flood: a fresh identity per batch
        await intake.offer(SimpleNamespace(sender=f"12D3KooWsybil{i}", message=batch(i)), "c")
        clock.t += 0.1  # 10 arrivals per second over 20 s
        await intake.drain()
    elapsed = clock.t - start
    flood_seconds = len(v.calls) * 1.0
    assert 3 < flood_seconds <= 0.1 * (elapsed - flood_seconds) + 3.0 + 1.0, (flood_seconds,
                                                                               elapsed)
    assert all(probe for _, probe in v.calls)  # one group first for senders without history
    # an established sender is served at once, flood or not
    establish(intake.reputation, HONEST)
    v.reason, v.cost = "ok", 0.0
    await intake.offer(SimpleNamespace(sender=HONEST, message=batch(999)), "c")
    assert not intake.share.ready()
    await intake.drain()
    assert (HONEST, False) in v.calls and intake.state.by_peer[HONEST].accepted == 4


async def test_4_a_flood_takes_short_turns_between_the_trainers_steps(tmp_path):
    """A trainer's drain between two steps (the default limits): with a full probation
    queue of fresh keys' bogus batches (50 ms each), the flood gets at most the 0.5-s bucket
    and one batch in flight before training gets its turn, and then only its refill (a
    2-s bucket spent at once stalled a trainer and its paced peer for seconds)."""
    clock = Clock()
    v = Scripted(clock, reason="proof_index_mismatch", cost=0.05)
    intake = make(tmp_path, v)
    for i in range(16):
        await intake.offer(SimpleNamespace(sender=f"12D3KooWsybil{i}", message=batch(i)), "c")
    t0 = clock.t
    await intake.drain()
    # at most the bucket, what it refills meanwhile (0.1 s per s) and the batch in flight
    # (less: the share halves below the floor as they fail, and its bucket with it)
    assert 0.05 <= clock.t - t0 <= 0.5 / (1 - 0.1) + 0.05
    clock.t += 1.0  # a step: 0.1 s of share comes back
    t1 = clock.t
    await intake.drain()
    assert clock.t - t1 <= 0.1 / (1 - 0.1) + 0.05


def test_time_share_refills_with_wall_time():
    clock = Clock()
    share = TimeShare(0.1, 2.0, clock)
    share.spend(5.0)  # a batch in flight overdraws it: its whole time is repaid
    assert not share.ready() and share.ready_in() == pytest.approx(30.0, abs=0.01)
    clock.t += 29.9
    assert not share.ready()
    clock.t += 0.2
    assert share.ready()


# bookkeeping (issue 11 finding 10 of an earlier round) --------------------------------------


async def test_trust_only_from_checks_config_costs_nothing_cheats_charge_the_connection(
        tmp_path):
    clock = Clock()
    intake = make(tmp_path, Scripted(clock, reason="unchecked"))
    rep = intake.reputation
    await send(intake, "12D3KooWpeerA", batch(0), origin="conn-a")
    assert rep.score("12D3KooWpeerA") == 0.0  # unchecked work earns no trust
    intake.verifier_for = lambda p: Scripted(clock, reason="config_task_mix")
    await send(intake, "12D3KooWpeerB", batch(1), origin="conn-b")
    assert rep.score("12D3KooWpeerB") == 0.0 and not intake.reports
    assert any(m.reason == "config_task_mix" and m.subject == "12D3KooWpeerB"
               for m in intake.published)  # the peer is told what to fix
    intake.verifier_for = lambda p: Scripted(clock, reason="proof_bias")
    await send(intake, "12D3KooWpeerC", batch(2), origin="conn-c")
    assert rep.is_banned("12D3KooWpeerC") and intake.reports == [("conn-c", "bogus_batch")]


async def test_a_banned_peer_is_told_once_per_interval(tmp_path):
    clock = Clock()
    intake = make(tmp_path, Scripted(clock, reason="proof_bias"))
    await send(intake, "12D3KooWcheat", batch(0))
    assert intake.reputation.is_banned("12D3KooWcheat")
    intake.reputation.unban("12D3KooWcheat")
    for k in range(3):
        intake.reputation.record("12D3KooWcheat", False, "proof_bias")
        await send(intake, "12D3KooWcheat", batch(k + 1))  # banned: rejected at the door
    notices = [m for m in intake.published if m.reason == "banned"]
    assert len(notices) == 1
    clock.t += IntakeLimits().ban_notice_s
    intake.reputation.unban("12D3KooWcheat")
    await send(intake, "12D3KooWcheat", batch(9))
    assert len([m for m in intake.published if m.reason == "banned"]) == 2


# 13: a full disk pauses verification; nothing accepted is lost ----------------------------


async def test_13_a_full_disk_pauses_the_intake_and_loses_nothing(tmp_path, kit, one_thread):
    """The seen-rollout store's commit failing with "database or disk is full" (SQLite has
    rolled it back itself: no "cannot rollback") pauses the intake, which retries the same
    batch once the store can write again: accepted, stored once, nothing lost or doubled."""
    import asyncio

    from swarm_node.node.testing import attacks
    from swarm_node.verifier.checks import RolloutVerifier
    from swarm_node.verifier.seen import SeenStore

    model, tokenizer, source = kit
    from swarm_node.node.diskspace import DiskFull

    seen = SeenStore(tmp_path / "seen.sqlite")
    pages = seen._db.execute("PRAGMA page_count").fetchone()[0]
    seen._db.execute(f"PRAGMA max_page_count = {pages}")  # the file cannot grow: full
    with pytest.raises(DiskFull):
        for k in range(1000):  # fill what room the file has
            seen.add([bytes([k % 256, k // 256]) * 16], 0, "12D3KooWfiller", k, b"")
    filled = seen.counts()
    verifier = RolloutVerifier(model, tokenizer, source, swarm_id="default",
                               latest_version=lambda: 0, seen=seen)
    intake = make(tmp_path, Scripted(Clock()))
    intake.verifier_for = lambda policy: verifier
    intake.clock = __import__("time").monotonic
    intake.disk.poll_s = 0.05
    b = attacks.sample_batch(model, tokenizer, source, "12D3KooWpeer", round_=0, version=0,
                             tasks=2, n=2, params=SamplingParams(max_new_tokens=8),
                             policy_id=OWN)
    tries = []
    verify = verifier.verify
    verifier.verify = lambda *a, **kw: tries.append(1) or verify(*a, **kw)
    await intake.offer(SimpleNamespace(sender="12D3KooWpeer", message=b), "c")
    drain = asyncio.create_task(intake.drain())
    # hit, retried once space looked free (the margin is), hit again: still one pause, the
    # intake not shown resumed by a retry that failed
    await async_wait_until(lambda: len(tries) >= 2 or drain.done(), 30,
                           "the intake to retry the batch on the full store")
    assert intake.disk.paused and intake.disk.pauses == 1
    assert not drain.done()  # paused: not crashed, not dropped
    assert "full" in intake.disk.detail
    assert intake.sink.stored == [] and seen.counts() == filled
    seen._db.execute("PRAGMA max_page_count = 1000000")  # space is back
    await asyncio.wait_for(drain, 60)
    assert intake.sink.stored == [("12D3KooWpeer", 4)]
    assert intake.state.by_peer["12D3KooWpeer"].accepted == 4
    assert seen.counts() == (filled[0] + 4, filled[1] + 1)
