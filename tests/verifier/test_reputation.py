"""Reputation: scores, decay, bans, persistence, spot checks and hints."""

from __future__ import annotations

import json

from swarm_node.node.config import VerifierSection
from swarm_node.protocol.messages import Verdict
from swarm_node.verifier.reputation import Reputation


class Clock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_accepts_raise_rejects_lower_and_ban(tmp_path):
    clock = Clock()
    rep = Reputation(tmp_path / "rep.json", ban_threshold=-5, ban_seconds=100, clock=clock)
    assert rep.record("a", True) == 1.0
    rep.record("b", False, "proof_index_mismatch")
    assert rep.score("b") == -5.0
    assert not rep.is_banned("b")
    rep.record("b", False, "proof_index_mismatch")
    assert rep.is_banned("b")
    assert rep.banned() == ["b"]
    assert not rep.is_banned("a")
    clock.t += 101
    assert not rep.is_banned("b")


def test_light_penalties_for_honest_mistakes():
    rep = Reputation(None, ban_threshold=-5)
    for _ in range(9):
        rep.record("slow", False, "stale_policy")
    assert not rep.is_banned("slow")  # 9 * -0.5 = -4.5


def test_score_decays_with_half_life():
    clock = Clock()
    rep = Reputation(None, half_life_s=10, clock=clock)
    for _ in range(8):
        rep.record("a", True)
    clock.t += 10
    assert abs(rep.score("a") - 4.0) < 1e-9
    clock.t += 10
    assert abs(rep.score("a") - 2.0) < 1e-9


def test_persisted_across_restarts(tmp_path):
    clock = Clock()
    path = tmp_path / "state" / "rep.json"
    rep = Reputation(path, ban_seconds=50, clock=clock, save_interval_s=1e9)
    rep.record("good", True)
    for _ in range(2):
        rep.record("bad", False, "logprob_mismatch")  # the ban saves at once
    rep.save()
    again = Reputation(path, clock=clock)
    assert again.is_banned("bad")
    assert again.score("good") == 1.0
    assert again.secret == rep.secret
    assert not list(path.parent.glob("*.tmp*"))


def test_corrupt_file_moved_aside(tmp_path):
    path = tmp_path / "rep.json"
    path.write_text("{not json")
    rep = Reputation(path)
    assert rep.peers == {}
    assert (tmp_path / "rep.json.corrupt").exists()
    path.write_text(json.dumps({"version": 1, "secret": "zz", "peers": {}}))
    assert Reputation(path).peers == {}


def test_spot_check_fraction_new_low_and_trusted():
    rep = Reputation(None, spot_check_fraction=0.1, new_peer_verdicts=5, trust_score=3,
                     half_life_s=0)
    assert rep.check_fraction("new") == 1.0
    for _ in range(5):
        rep.record("ok", True)
    assert rep.check_fraction("ok") == 0.1
    for _ in range(4):
        rep.record("meh", True)
    rep.record("meh", False, "proof_bias")
    assert rep.check_fraction("meh") == 1.0  # old enough, but score 4 - 5 < trust_score
    picked = sum(rep.should_verify("ok", i.to_bytes(8, "little")) for i in range(4000))
    assert 250 < picked < 550


def test_spot_check_is_keyed_by_local_secret():
    a, b = Reputation(None, spot_check_fraction=0.5, new_peer_verdicts=0, trust_score=-1), \
        Reputation(None, spot_check_fraction=0.5, new_peer_verdicts=0, trust_score=-1)
    a.record("p", True)
    b.record("p", True)
    ids = [i.to_bytes(4, "little") for i in range(200)]
    assert [a.should_verify("p", i) for i in ids] != [b.should_verify("p", i) for i in ids]


def test_hints_make_suspect_but_never_ban():
    clock = Clock()
    rep = Reputation(None, spot_check_fraction=0.0, new_peer_verdicts=0, trust_score=-100,
                     suspect_seconds=60, clock=clock)
    rep.record("subject", True)
    assert rep.check_fraction("subject") == 0.0
    verdict = Verdict(rollout_id=b"\x01" * 32, subject="subject", accept=False,
                      reason="proof_index_mismatch")
    for _ in range(50):
        assert rep.hint(verdict, "other")
    assert not rep.is_banned("subject")
    assert rep.score("subject") == 1.0
    assert rep.check_fraction("subject") == 1.0
    clock.t += 61
    assert rep.check_fraction("subject") == 0.0
    assert not rep.hint(verdict, "subject")  # about itself
    accept = Verdict(rollout_id=b"\x01" * 32, subject="subject", accept=True, reason="ok")
    assert not rep.hint(accept, "other")


def test_bounded_peer_table():
    rep = Reputation(None, max_peers=10)
    for i in range(25):
        rep.record(f"p{i}", True)
    assert len(rep.peers) == 10


def test_from_config(tmp_path):
    section = VerifierSection(spot_check_fraction=0.25, ban_seconds=7)
    rep = Reputation.from_config(section, tmp_path / "r.json")
    assert rep.spot_check_fraction == 0.25 and rep.ban_seconds == 7


def test_verdict_flood_about_made_up_subjects_is_bounded():
    """Issue 17 finding 7: each hint about a new subject costs O(1) and bounded memory."""
    rep = Reputation(None, max_suspects=100)
    for i in range(5000):
        v = Verdict(rollout_id=b"\x01" * 32, subject=f"made-up-{i}", accept=False,
                    reason="proof_bias")
        assert rep.hint(v, "flooder")
    assert len(rep.suspects) == 100 and len(rep.peers) == 0
    assert rep.check_fraction("made-up-4999") == 1.0


def test_peer_table_is_lru_and_keeps_banned_peers(tmp_path):
    clock = Clock()
    rep = Reputation(None, max_peers=5, clock=clock)
    rep.record("cheat", False, "proof_bias")
    rep.record("cheat", False, "proof_bias")
    assert rep.is_banned("cheat")
    for i in range(20):
        rep.record(f"p{i}", True)
    assert len(rep.peers) == 5 and rep.is_banned("cheat")
    assert "p19" in rep.peers and "p0" not in rep.peers


def test_saves_are_incremental_journal_lines(tmp_path):
    """A ban appends one journal line; the snapshot is not rewritten; a restart replays the
    journal and ignores a torn last line."""
    path = tmp_path / "rep.json"
    rep = Reputation(path, save_interval_s=1e9)
    for i in range(200):
        rep.record(f"peer{i}", True)
    rep.save()
    snapshot = path.read_bytes()
    journal = path.with_name("rep.json.log")
    before = len(journal.read_text().splitlines()) if journal.exists() else 0
    rep.record("bad", False, "proof_bias")
    rep.record("bad", False, "proof_bias")  # banned: saved at once
    assert path.read_bytes() == snapshot
    assert len(journal.read_text().splitlines()) - before == 1  # one line for the ban
    with open(journal, "a") as f:
        f.write('{"peer": "torn", "rec')  # a crash mid-write
    again = Reputation(path)
    assert again.is_banned("bad") and len(again.peers) == 201


def test_an_alarm_restarts_probation_and_raises_what_ends_it():
    """Issue 30: a caught steerer with 16 accepted completions was established again after
    one accepted batch (score > 0, accepted >= 8). An alarm now restarts the count (only
    completions accepted after it) and multiplies what is needed: 8 -> 64 -> 512
    (capped); a second alarm before that bans it."""
    rep = Reputation(None, probation_accepts=8)
    for _ in range(16):
        rep.record("steerer", True)
    assert rep.established("steerer") and rep.probation_needs("steerer") == 8
    rep.record_alarm("steerer", "tie_steering")
    assert not rep.is_banned("steerer") and not rep.established("steerer")
    assert rep.probation_needs("steerer") == 64
    for _ in range(32):  # two batches of 16: enough before, not now
        rep.record("steerer", True)
    assert rep.score("steerer") > 0 and not rep.established("steerer")
    for _ in range(32):
        rep.record("steerer", True)
    assert rep.established("steerer")  # 64 accepted since the alarm
    rep.record_alarm("steerer", "tie_steering")  # established again: not banned, longer
    assert rep.probation_needs("steerer") == 512 and not rep.established("steerer")
    rep.record_alarm("steerer", "tie_steering")  # on probation: banned
    assert rep.is_banned("steerer")
    rep.peers["steerer"].alarms = 9
    assert rep.probation_needs("steerer") == 512


def test_alarm_record_persists(tmp_path):
    path = tmp_path / "rep.json"
    rep = Reputation(path, probation_accepts=8)
    for _ in range(16):
        rep.record("steerer", True)
    rep.record_alarm("steerer", "tie_steering")  # saves at once
    for _ in range(8):
        rep.record("steerer", True)
    rep.save()
    again = Reputation(path, probation_accepts=8)
    assert again.peers["steerer"].alarms == 1
    assert again.peers["steerer"].accepted_at_alarm == 16
    assert not again.established("steerer") and again.probation_needs("steerer") == 64
    # a snapshot written before these fields existed still loads
    state = json.loads(path.read_text())
    for rec in state["peers"].values():
        rec.pop("alarms", None)
        rec.pop("accepted_at_alarm", None)
    path.write_text(json.dumps(state))
    (tmp_path / "rep.json.log").unlink(missing_ok=True)
    assert Reputation(path).peers["steerer"].alarms == 0


def test_alarms_are_forgiven_one_a_day_and_that_persists(tmp_path):
    """Issue 30: alarms never decayed, so an honest peer with one false alarm long ago was
    still on a 64-completion probation after each later one (512 after two). One alarm is
    forgiven per ALARM_FORGIVE_S since the last; the time is persisted with the record."""
    from swarm_node.verifier.reputation import ALARM_FORGIVE_S

    clock = Clock()
    path = tmp_path / "rep.json"
    rep = Reputation(path, probation_accepts=8, clock=clock)
    for _ in range(16):
        rep.record("peer", True)
    rep.record_alarm("peer", "tie_steering")  # saves at once
    alarmed = clock.t
    assert rep.probation_needs("peer") == 64 and rep.reprobation("peer")
    clock.t += ALARM_FORGIVE_S - 1
    assert rep.alarms("peer") == 1 and rep.reprobation("peer")
    assert Reputation(path, probation_accepts=8, clock=clock).probation_needs("peer") == 64
    clock.t += 1
    assert rep.alarms("peer") == 0 and rep.probation_needs("peer") == 8
    assert not rep.reprobation("peer")
    again = Reputation(path, probation_accepts=8, clock=clock)  # a restart: the same
    assert again.alarms("peer") == 0 and again.peers["peer"].alarm_at == alarmed
    # two on record: one a day; a new alarm adds to what is left, from its own time
    rec = rep.peers["peer"]
    rec.alarms, rec.alarm_at = 2, clock.t
    clock.t += ALARM_FORGIVE_S
    assert rep.probation_needs("peer") == 64
    rep.record_alarm("peer", "tie_steering")
    assert rep.alarms("peer") == 2 and rep.probation_needs("peer") == 512
    clock.t += 2 * ALARM_FORGIVE_S
    assert rep.alarms("peer") == 0
    # a record from before `alarm_at`: its last update stands for the alarm's time
    rep.save()
    rep._snapshot()
    state = json.loads(path.read_text())
    state["peers"]["peer"].pop("alarm_at")
    path.write_text(json.dumps(state))
    old = Reputation(path, clock=clock)
    assert old.peers["peer"].alarm_at == old.peers["peer"].updated
