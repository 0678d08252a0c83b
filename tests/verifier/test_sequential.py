"""Findings 7 and 8 of issue 11: what the per-completion tolerance lets through is caught
across batches by the per-peer sequential tests (verifier/sequential.py), on the tiny model
with bf16-sized tolerances, and honest batches under the same settings raise no alarm."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
from swarm_node.node.testing import attacks
from swarm_node.protocol.messages import SamplingParams, TensorData
from swarm_node.verifier.checks import CheckSettings, RolloutVerifier
from swarm_node.verifier.sequential import PeerMonitor, SequentialSettings

SENDER = "12D3KooWSequentialPeer"
PARAMS = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=24)
LOOSE = CheckSettings(logprob_tol=0.1, tie_eps=0.1)  # the bf16 tolerances of issue 11


@pytest.fixture(scope="module")
def kit(tiny_model_dir):
    from swarm_node.node.models import load_model
    from swarm_node.node.tasks import TaskSource

    torch.set_num_threads(1)
    model, tokenizer = load_model(tiny_model_dir)
    return model, tokenizer, TaskSource({"toy/digit_copy": 1.0}, "default")


def batches(kit, rounds):
    model, tokenizer, source = kit
    return [attacks.sample_batch(model, tokenizer, source, SENDER, round_=r, version=0,
                                 tasks=2, n=2, params=PARAMS) for r in rounds]


def run(kit, monitor, batch, sender=SENDER):
    model, tokenizer, source = kit
    v = RolloutVerifier(model, tokenizer, source, swarm_id="default",
                        latest_version=lambda: 0, settings=LOOSE)
    results = v.verify(batch, sender)
    assert {r.reason for r in results} == {"ok"}, [(r.reason, r.detail) for r in results]
    return [monitor.observe(sender, r.stats) for r in results]


def test_8_near_tie_steering_passes_each_check_but_not_the_peer_test(kit):
    model, tokenizer, _ = kit
    honest_monitor, cheat_monitor = PeerMonitor(), PeerMonitor()
    honest_alarms, detected_at = [], None
    for k in range(6):
        batch = batches(kit, [k])[0]
        honest_alarms += [a for a in run(kit, honest_monitor, batch) if a]
        steered = attacks.steer_near_ties(batch, model, tokenizer, LOOSE.tie_eps)
        if "tie_steering" in run(kit, cheat_monitor, steered):
            detected_at = k + 1
            break
    assert honest_alarms == []
    assert detected_at is not None and detected_at <= 6
    st = cheat_monitor.peers[SENDER]
    assert st.alarms["tie_steering"] >= 1


def test_7_logprob_bias_inside_the_tolerance_is_caught_across_batches(kit):
    honest_monitor, cheat_monitor = PeerMonitor(), PeerMonitor()
    detected_at = None
    for k in range(3):
        batch = batches(kit, [20 + k])[0]
        assert not any(run(kit, honest_monitor, batch))
        biased = batch.model_copy(update={"completions": [
            c.model_copy(update={"logprobs": TensorData.from_numpy(
                c.logprobs.to_numpy() - np.float32(0.09))}) for c in batch.completions]})
        if "logprob_bias" in run(kit, cheat_monitor, biased):
            detected_at = k + 1
            break
    assert detected_at is not None and detected_at <= 3


def test_bias_test_follows_the_honest_offset_of_the_dtype():
    """bf16 honest errors sit above zero (the sampler's rounding helped pick its token):
    with the bf16 parameters such an offset raises no alarm, a downward shift does."""
    s = SequentialSettings.for_dtype("bfloat16")
    m = PeerMonitor(s)
    rng = random.Random(0)
    for _ in range(2000):
        n = 32
        err = sum(rng.gauss(s.bias_mu, s.bias_sigma) for _ in range(n))
        assert m.observe("honest", {"lp_err_sum": err, "lp_n": n}) is None
    alarms = [m.observe("cheat", {"lp_err_sum": (s.bias_mu - 0.09) * 32, "lp_n": 32})
              for _ in range(10)]
    assert "logprob_bias" in alarms


def test_fp32_one_flipped_wide_tie_alarms_honest_float_noise_does_not():
    """fp32 (session 8): an honest flip at a wide tie (margin > 2.5e-4) needs a pair error
    of that size; none of 16,913 measured positions came near (max 5.2e-5), so p0 is the
    95% bound 3 / 16,913 and one flipped wide tie alarms. Honest peers whose pair errors
    follow the measured spread (median |d| 5.7e-6) never flip a wide tie and never alarm."""
    s = SequentialSettings.for_dtype("float32")
    assert s.flip_p0 <= 3 / 15_000 and s.steer_h < math.log(s.flip_p1 / s.flip_p0)
    m = PeerMonitor(s)
    assert m.observe("cheat", {"wide_ties": 1, "wide_flips": 1}) == "tie_steering"
    # a cheater steering half the wide ties is caught at its first steered one
    half = [m.observe("half", {"wide_ties": 1, "wide_flips": k % 2}) for k in range(2)]
    assert half == [None, "tie_steering"]
    rng = random.Random(0)
    honest = []
    for _ in range(20_000):
        margins = [rng.uniform(2.5e-4, 1e-3) for _ in range(rng.randint(0, 2))]
        flips = sum(abs(rng.gauss(0.0, 8.5e-6)) >= mg for mg in margins)
        honest.append(m.observe("honest", {"wide_ties": len(margins), "wide_flips": flips}))
    assert not any(honest)
    # the bf16 test keeps its measured p0 (honest bf16 flips are common) and two-flip rule
    assert SequentialSettings.for_dtype("bfloat16").flip_p0 == 0.1


def test_narrower_ties_are_counted_from_the_margins_when_wide_min_is_set():
    """`wide_min` (measured in benchmarks/verifier_real.py steering_study, not used by
    for_dtype): ties with margin above it are counted from `tie_margins` / `tie_flipped`
    instead of the verifier's wide ties (tie_eps / 4)."""
    stats = {"wide_ties": 0, "wide_flips": 0, "tie_margins": [2e-4, 5e-5],
             "tie_flipped": [True, True]}
    one = {"flip_p0": 1e-4, "steer_h": 7.0}
    assert PeerMonitor(SequentialSettings(**one)).observe("p", stats) is None
    narrow = PeerMonitor(SequentialSettings(**one, wide_min=1e-4))
    assert narrow.observe("p", stats) == "tie_steering"
    # the flip below wide_min is not counted: the unflipped tie above it only lowers g
    assert narrow.observe("q", {**stats, "tie_flipped": [False, True]}) is None
    assert narrow.peers["q"].steer == 0.0


def test_bf16_steering_threshold_is_15():
    """bf16 steering alarms at h 15 (RESULTS.md verifier-real, session 7: stress false alarms
    3e-4 -> 0 per batch of 32): ten flipped wide ties in a row alarm, nine do not."""
    s = SequentialSettings.for_dtype("bfloat16")
    assert s.steer_h == 15.0
    m = PeerMonitor(s)
    steer = [m.observe("cheat", {"wide_ties": 1, "wide_flips": 1}) for _ in range(10)]
    assert steer[:9] == [None] * 9 and steer[9] == "tie_steering"


def test_replay_outliers_alarm_when_a_peer_uses_them_often():
    """bf16 allows one replay outlier per completion (rare honestly: 1 in 292 measured); a
    peer with one in every other completion is alarmed within a batch of 32, a peer with one
    in 50 (6x the measured rate) never in 20,000 completions."""
    s = SequentialSettings.for_dtype("bfloat16")
    m = PeerMonitor(s)
    cheat = [m.observe("cheat", {"replay_outliers": k % 2}) for k in range(32)]
    assert "tie_steering" in cheat
    honest = [m.observe("honest", {"replay_outliers": int(k % 50 == 0)}) for k in range(20_000)]
    assert not any(honest)


def test_steer_h_sets_the_steering_threshold_alone():
    """`steer_h` (the bootstrap's single-flip alternative, benchmarks/verifier_real.py)
    moves only the steering CUSUM's threshold: with steer_h below log(p1/p0) one flipped
    wide tie alarms; the bias and outlier tests keep h."""
    two = SequentialSettings(flip_p0=1e-3)  # session 7's fp32 test: two flips alarm
    one = PeerMonitor(SequentialSettings(flip_p0=two.flip_p0, steer_h=6.0))
    assert one.observe("c", {"wide_ties": 1, "wide_flips": 1}) == "tie_steering"
    assert PeerMonitor(two).observe("c", {"wide_ties": 1, "wide_flips": 1}) is None
    outliers = [one.observe("o", {"replay_outliers": 1}) for _ in range(4)]
    assert outliers == [None] * 3 + ["tie_steering"]  # log(0.5 / 0.02) = 3.2 each, h 12


# issue 30: many identities (7), narrow ties (8) ----------------------------------------------


def _ties(wide: int, wide_flips: int, narrow: int = 0, narrow_flips: int = 0) -> dict:
    """bf16 stats of one completion with `wide` ties of margin 0.3 and `narrow` of 0.05."""
    margins = [0.3] * wide + [0.05] * narrow
    flipped = ([True] * wide_flips + [False] * (wide - wide_flips)
               + [True] * narrow_flips + [False] * (narrow - narrow_flips))
    return {"tie_margins": margins, "tie_flipped": flipped}


def test_7_one_batch_of_a_sender_without_history_is_judged_alone():
    """Finding 7: a fresh identity never sends twice, so its CUSUM never builds up: a
    batch whose own evidence passes batch_h (8 flipped wide ties in bf16: 12.9 > 11) alarms
    for a sender on probation; the same batch from an established sender stays under its
    CUSUM threshold (15) and alarms only if it goes on."""
    s = SequentialSettings.for_dtype("bfloat16")
    batch = [_ties(1, 1)] * 8
    alarm = PeerMonitor(s).observe_batch("fresh", batch, probation=True)
    assert alarm is not None and alarm.test == "batch" and alarm.peers == ("fresh",)
    est = PeerMonitor(s)
    assert est.observe_batch("est", batch, probation=False) is None
    assert est.observe_batch("est", batch, probation=False).test == "peer"


def test_7_sybils_each_sending_one_batch_are_caught_together():
    """Finding 7: three fresh identities each steering every narrow tie of ONE batch: no
    batch alone passes batch_h, the pooled test over senders on probation does, and it
    blames exactly the three of them, not the honest newcomer whose batch came between."""
    s = SequentialSettings.for_dtype("bfloat16")
    m = PeerMonitor(s)
    steer = [_ties(0, 0, narrow=2, narrow_flips=2)] * 4  # 8 flipped narrow ties: 5.5
    honest = [_ties(4, 0, narrow=2, narrow_flips=1)] * 4
    assert m.observe_batch("sybil-1", steer, probation=True) is None
    assert m.observe_batch("newcomer", honest[:1], probation=True) is None
    assert m.observe_batch("sybil-2", steer, probation=True) is None
    alarm = m.observe_batch("sybil-3", steer, probation=True)
    assert alarm is not None and alarm.test == "pooled" and alarm.reason == "tie_steering"
    assert set(alarm.peers) == {"sybil-1", "sybil-2", "sybil-3"}
    # honest newcomers alone, at the measured honest flip rates, never add up
    m = PeerMonitor(s)
    rng = random.Random(1)
    for k in range(3000):
        comps = [_ties(6, int(rng.random() < 0.04), narrow=2,
                       narrow_flips=sum(rng.random() < 0.25 for _ in range(2)))
                 for _ in range(8)]
        assert m.observe_batch(f"new-{k}", comps, probation=True) is None


def test_7_a_pooled_alarm_with_the_senders_own_keeps_its_blame():
    """Found against the real trainer (tests/integration/test_trainer_steering.py): when the
    batch that tips the pooled test also sets off its sender's own test, the alarm returned
    was the sender's alone and the earlier sybils the pooled test blamed went free. The
    returned alarm now condemns them too."""
    s = SequentialSettings.for_dtype("bfloat16")
    m = PeerMonitor(s)
    quiet = [_ties(1, 1)] * 5 + [_ties(1, 0)] * 3  # 5 x 1.61 - 3 x 0.59 = 6.3: under 11
    assert m.observe_batch("sybil-1", quiet, probation=True) is None
    assert m.observe_batch("sybil-2", quiet, probation=True) is None
    loud = [_ties(1, 1)] * 10  # 16.1: its own CUSUM (15) and the pooled one (28.7) fire
    alarm = m.observe_batch("sybil-3", loud, probation=True)
    assert alarm is not None and alarm.test == "peer" and alarm.peers[0] == "sybil-3"
    assert set(alarm.peers) == {"sybil-1", "sybil-2", "sybil-3"}
    assert m.pooled_alarms == 1


def test_8_narrow_ties_are_watched():
    """Finding 8: steering only narrow ties (which honest bf16 floats reorder about a
    quarter of the time, measured on SmolLM2) is caught by the narrow-tie CUSUM, which the
    honest wide ties' downward drift cannot hide; honest flips at the measured rate never
    alarm."""
    s = SequentialSettings.for_dtype("bfloat16")
    assert s.narrow and s.tie_eps == CheckSettings.for_dtype("bfloat16").tie_eps
    m = PeerMonitor(s)
    rng = random.Random(0)
    caught = None
    for b in range(20):
        comps = [_ties(6, int(rng.random() < 0.04), narrow=2,
                       narrow_flips=sum(rng.random() < 0.75 for _ in range(2)))
                 for _ in range(32)]
        if m.observe_batch("steerer", comps, probation=False) is not None:
            caught = b + 1
            break
    assert caught is not None and caught <= 3
    for _ in range(600):
        comps = [_ties(6, int(rng.random() < 0.04), narrow=2,
                       narrow_flips=sum(rng.random() < 0.25 for _ in range(2)))
                 for _ in range(32)]
        assert m.observe_batch("honest", comps, probation=False) is None


def test_8_narrow_tie_steering_through_the_real_intake_in_bf16(tiny_model_dir, tmp_path):
    """Finding 8 as found: the tiny model in bf16, one established identity taking the
    runner-up at every narrow tie and a quarter of the wide ones, through the real intake
    and verifier: every batch passes the per-rollout checks, the narrow-tie CUSUM alarms
    within 3 batches, the alarmed batch never reaches the trainer; an honest sender beside
    it raises nothing."""
    import asyncio
    from types import SimpleNamespace

    from swarm_node.node.diskspace import DiskWatch
    from swarm_node.node.metrics import NodeState
    from swarm_node.node.models import load_model
    from swarm_node.node.tasks import TaskSource
    from swarm_node.verifier.intake import Intake
    from swarm_node.verifier.reputation import Reputation

    torch.set_num_threads(1)
    model, tokenizer = load_model(tiny_model_dir, dtype="bfloat16")
    source = TaskSource({"toy/digit_copy": 1.0}, "default")
    params = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=16)
    settings = CheckSettings.for_dtype("bfloat16")
    verifier = RolloutVerifier(model, tokenizer, source, swarm_id="default",
                               latest_version=lambda: 0, dtype="bfloat16")
    stored = []
    sink = SimpleNamespace(add_external=lambda b, sender="", as_of=None: stored.append(sender),
                           drop_sender=lambda sender: 0)

    async def inline(fn, *args):
        return fn(*args)

    async def publish(v):
        pass

    rep = Reputation(None)
    for peer in ("cheat", "honest"):
        for _ in range(20):
            rep.record(peer, True)
    intake = Intake("trainer", rep, lambda policy: verifier, sink,
                    NodeState("trainer", "trainer", "default"), publish=publish, work=inline,
                    disk=DiskWatch("test", tmp_path),
                    monitor=PeerMonitor(SequentialSettings.for_dtype("bfloat16")))

    async def run():
        steered, alarmed_at = [], None
        for k in range(4):
            honest = attacks.sample_batch(model, tokenizer, source, "honest", round_=k,
                                          version=0, tasks=2, n=4, params=params,
                                          policy_id="trainer").model_copy(
                                              update={"dtype": "bfloat16"})
            base = attacks.sample_batch(model, tokenizer, source, "cheat", round_=k,
                                        version=0, tasks=2, n=4, params=params,
                                        policy_id="trainer")
            cheat = attacks.steer_near_ties(base, model, tokenizer, settings.tie_eps,
                                            rate=0.25, narrow_rate=1.0, steered=steered,
                                            rng=random.Random(k)).model_copy(
                                                update={"dtype": "bfloat16"})
            for sender, b in (("honest", honest), ("cheat", cheat)):
                await intake.offer(SimpleNamespace(sender=sender, message=b), "conn")
            await intake.drain()
            if intake.state.by_peer["cheat"].reasons.get("tie_steering"):
                alarmed_at = k + 1
                break
        return steered, alarmed_at

    steered, alarmed_at = asyncio.run(run())
    assert sum(n for n, _ in steered) > 0
    assert alarmed_at is not None and alarmed_at <= 3
    assert stored.count("cheat") == alarmed_at - 1  # the alarmed batch was not stored
    honest = intake.state.by_peer["honest"]
    assert honest.rejected == 0 and honest.accepted == 8 * alarmed_at
    assert not intake.state.by_peer["cheat"].reasons.keys() - {"tie_steering"}


def test_a_condemned_peer_restarts_with_a_head_start():
    """Issue 30: after an alarm a peer's CUSUMs restart at 0.6 of their threshold and do
    not fall below it while it is on probation (fast initial response with a floor), so a
    steerer that goes on is caught by 40% of the evidence (here: 4 flipped wide ties in
    bf16, h 15, instead of 10), even after honest batches in between; out of probation
    the floor is gone."""
    s = SequentialSettings.for_dtype("bfloat16")
    m = PeerMonitor(s)
    m.condemned("cheat")
    assert m.peers["cheat"].steer == pytest.approx(9.0)
    assert m.peers["cheat"].narrow == pytest.approx(7.2)
    honest = [_ties(6, 0, narrow=2, narrow_flips=0)] * 8
    assert m.observe_batch("cheat", honest, probation=True) is None
    assert m.peers["cheat"].steer == pytest.approx(9.0)
    steer = [m.observe("cheat", {"wide_ties": 1, "wide_flips": 1}) for _ in range(4)]
    assert steer[:3] == [None] * 3 and steer[3] == "tie_steering"
    assert m.observe_batch("cheat", honest, probation=False) is None
    assert m.peers["cheat"].steer == 0.0 and m.peers["cheat"].narrow == 0.0


def test_a_condemned_honest_peer_rarely_alarms_again():
    """What the floor costs an honest peer a false alarm put back on probation: at the
    measured bf16 honest flip rates (wide 4%, narrow 25%), over the 64 completions its
    probation needs after one alarm (reputation.py: 8 x 8), it alarms again (and is
    banned) in under 2.5% of 4,000 trials (measured 1.3%: with the ~1e-4 false alarms
    per batch that put it there, ~1e-6 per batch)."""
    s = SequentialSettings.for_dtype("bfloat16")
    rng = random.Random(7)
    again = 0
    for t in range(4000):
        m = PeerMonitor(s)
        m.condemned("p")
        for _ in range(8):
            comps = [_ties(6, int(rng.random() < 0.04), narrow=2,
                           narrow_flips=sum(rng.random() < 0.25 for _ in range(2)))
                     for _ in range(8)]
            if m.observe_batch("p", comps, probation=True) is not None:
                again += 1
                break
    print(f"condemned honest peers alarming again within their probation: {again} / 4000")
    assert again <= 100
