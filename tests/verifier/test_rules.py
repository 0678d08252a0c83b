"""Issue 11 on the tiny model: honest peers never punished, no free choices, verified data only.

Each test names the numbered finding of the issue it covers.
"""

from __future__ import annotations

import copy
import random

import numpy as np
import pytest
import torch
from swarm_node.node.testing import attacks
from swarm_node.protocol.messages import BatchRules, SamplingParams, TensorData
from swarm_node.verifier.checks import CheckSettings, RolloutVerifier
from swarm_node.verifier.reasons import CONFIG_REASONS, HONEST_MISTAKES
from swarm_node.verifier.reputation import Reputation
from swarm_node.verifier.seen import ROUND_MEMORY, SeenStore

SENDER = "12D3KooWHonestInferencePeer"
PARAMS = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=16)
VERSION = 3
RULES = BatchRules(completions_per_task=3, tasks_per_round=2, rounds_per_version=4)
ROUND = RULES.round_for(VERSION, 0)


pytestmark = pytest.mark.usefixtures("one_thread")  # kit, one_thread: conftest.py


def verifier(kit, model=None, **kw) -> RolloutVerifier:
    m, tokenizer, source = kit
    kw.setdefault("latest_version", lambda: VERSION)
    kw.setdefault("rules", RULES)
    return RolloutVerifier(model or m, tokenizer, source, swarm_id="default", **kw)


def sample(kit, model=None, round_=ROUND, tasks=2, n=3, **kw):
    m, tokenizer, source = kit
    return attacks.sample_batch(model or m, tokenizer, source, SENDER, params=PARAMS,
                                version=VERSION, round_=round_, tasks=tasks, n=n, **kw)


@pytest.fixture(scope="module")
def honest(kit):
    return sample(kit)


def reasons(results) -> set[str]:
    return {r.reason for r in results}


# 1-5: honest peers are never punished -----------------------------------------------------


def test_2_second_eos_of_generation_config_is_an_honest_finish(kit):
    """Finding 2: the sampler stops on every EOS id of tokenizer + generation_config; the
    verifier uses the same set (node/sampler/stops.py)."""
    model, tokenizer, _ = kit
    first = sample(kit, round_=ROUND + 1)
    # a token the model really emits early becomes the model's second EOS id
    extra = int(first.completions[0].completion_ids.to_numpy()[0])
    two_eos = copy.deepcopy(model)
    two_eos.generation_config.eos_token_id = [tokenizer.eos_token_id, extra]
    batch = sample(kit, model=two_eos, round_=ROUND + 1)
    ends = [int(c.completion_ids.to_numpy()[-1]) for c in batch.completions
            if c.finish_reason == "eos"]
    assert extra in ends, "no completion stopped on the second EOS id"
    assert reasons(verifier(kit, model=two_eos).verify(batch, SENDER)) == {"ok"}
    # a verifier that knew only the tokenizer's EOS would call these bad_finish
    assert "bad_finish" in reasons(verifier(kit, model=model).verify(batch, SENDER))


def test_3_context_limit_is_min_of_config_and_model(kit):
    """Finding 3: a `length` stop at the model's own context is honest even when the
    configured max_context is larger."""
    from swarm_node.node.sampler.stops import context_limit

    model, _, _ = kit
    short = copy.deepcopy(model)
    prompt_len = sample(kit, tasks=1, n=1).completions[0].prompt_ids.shape[0]
    short.config.max_position_embeddings = prompt_len + 5
    assert context_limit(short.config, 1 << 20) == prompt_len + 5
    batch = sample(kit, model=short, tasks=1, n=3, round_=ROUND + 2)
    assert any(c.finish_reason == "length" and c.completion_ids.shape[0] <= 5
               for c in batch.completions)
    v = verifier(kit, model=short, max_context=1 << 20)  # the config says "huge"
    assert reasons(v.verify(batch, SENDER)) == {"ok"}


def test_4_retention_covers_max_staleness():
    """Finding 4: the trainer keeps max_staleness + 1 versions of its own and of followed
    policies, plus the configured `verifier.queue_grace` (default 2) for batches that waited
    in its verification queue (issue 30), whatever keep_checkpoints / keep_versions say."""
    from swarm_node.node.config import Config
    from swarm_node.verifier.rules import retention

    cfg = Config.model_validate({"trainer": {"max_staleness": 4, "keep_checkpoints": 3}})
    assert cfg.verifier.queue_grace == 2
    assert retention(cfg, cfg.trainer.keep_checkpoints) == 5 + 2
    for grace in (0, 5):
        other = cfg.with_overrides({"verifier.queue_grace": grace})
        assert retention(other, other.trainer.keep_checkpoints) == 5 + grace
    cfg = cfg.with_overrides({"trainer.keep_checkpoints": 9})
    assert retention(cfg, cfg.trainer.keep_checkpoints) == 9


def test_5_honest_misconfiguration_is_never_punished(kit, honest):
    """Finding 5: another task mix, sampling parameters, dtype, group size or round
    numbering get config reasons with no reputation penalty."""
    from swarm_node.node.tasks import TaskSource

    model, tokenizer, _ = kit
    other_mix = RolloutVerifier(model, tokenizer, TaskSource({"toy/digit_predecessor": 1.0},
                                                             "default"),
                                swarm_id="default", latest_version=lambda: VERSION, rules=RULES)
    got = {
        "config_task_mix": other_mix.verify(honest, SENDER),
        "sampling_params": verifier(kit, sampling=SamplingParams(temperature=0.7)).verify(
            honest, SENDER),
        "config_dtype": verifier(kit).verify(honest.model_copy(update={"dtype": "bfloat16"}),
                                             SENDER),
        "config_group_size": verifier(kit, rules=RULES.model_copy(
            update={"completions_per_task": 2})).verify(honest, SENDER),
        "round_out_of_range": verifier(kit, rules=RULES.model_copy(
            update={"rounds_per_version": 2})).verify(
                honest.model_copy(update={"round": ROUND + 3}), SENDER),
    }
    rep = Reputation(None)
    for code, results in got.items():
        assert code in reasons(results) and code in CONFIG_REASONS, (code, reasons(results))
        for r in results:
            rep.record(SENDER, r.accept, r.reason)
    assert rep.score(SENDER) == 0.0 and not rep.is_banned(SENDER)
    assert CONFIG_REASONS <= HONEST_MISTAKES


def test_bf16_batch_checked_in_bf16(kit, tiny_model_dir):
    """The batch states the prover's dtype; a bf16 verifier checks a bf16 prover's batch
    with the bf16 thresholds (an honest dtype difference is never a cheat)."""
    from swarm_node.node.models import load_model

    bf16, _ = load_model(tiny_model_dir, dtype="bfloat16")
    batch = sample(kit, model=bf16, round_=ROUND + 3).model_copy(update={"dtype": "bfloat16"})
    v = verifier(kit, model=bf16, dtype="bfloat16")
    assert reasons(v.verify(batch, SENDER)) == {"ok"}
    assert reasons(verifier(kit).verify(batch, SENDER)) == {"config_dtype"}


# 6-7: the trainer gets only verified data --------------------------------------------------


def test_6_text_comes_from_the_verified_ids(kit, honest):
    """Finding 6: an empty or different claimed text cannot change what is trained on."""
    _, tokenizer, _ = kit
    blank = honest.model_copy(update={"completions": [
        c.model_copy(update={"text": ""}) for c in honest.completions]})
    results = verifier(kit).verify(blank, SENDER)
    assert reasons(results) == {"ok"}
    for r, c in zip(results, honest.completions):
        assert r.text == tokenizer.decode(c.completion_ids.to_numpy().tolist(),
                                          skip_special_tokens=True)
        assert r.reward == c.claimed_reward
    wrong = honest.model_copy(update={"completions": [
        c.model_copy(update={"text": c.text + " 9"}) for c in honest.completions]})
    assert "text_mismatch" in reasons(verifier(kit).verify(wrong, SENDER))


def test_7_trainer_gets_recomputed_logprobs_not_claimed_ones(kit, honest):
    """Finding 7: a bias inside the tolerance reaches the trainer as the recomputed values."""
    from swarm_node.verifier.intake import _verified_completion

    biased = honest.model_copy(update={"completions": [
        c.model_copy(update={"logprobs": TensorData.from_numpy(
            c.logprobs.to_numpy() - np.float32(0.09))}) for c in honest.completions]})
    v = verifier(kit, settings=CheckSettings(logprob_tol=0.1))
    results = v.verify(biased, SENDER)
    assert reasons(results) == {"ok"}
    for r, c, h in zip(results, biased.completions, honest.completions):
        handed = _verified_completion(c, r)
        np.testing.assert_allclose(handed.logprobs.to_numpy(), h.logprobs.to_numpy(), atol=1e-4)
        assert handed.text == r.text


# 9-11: no replays, spot checks per group, no cherry-picking ---------------------------------


def test_the_wait_in_the_verifiers_queue_is_not_the_senders_lag(kit, honest):
    """Issue 30 (newcomers): staleness is judged as of the batch's arrival (`as_of`, set by
    the intake), for at most `queue_grace` versions of waiting; past that the batch is
    `queue_expired`, which costs its sender nothing. A batch that arrives stale is stale
    (holding it back gains nothing). The real trainer role: test_queue_wait.py."""
    from swarm_node.verifier.reputation import PENALTIES

    s = CheckSettings()
    now = {"v": VERSION + s.max_policy_lag + 1}
    v = verifier(kit, latest_version=lambda: now["v"])
    assert reasons(v.verify(honest, SENDER)) == {"stale_policy"}  # arrives now: stale
    assert reasons(v.verify(honest, SENDER, as_of=now["v"])) == {"stale_policy"}
    now["v"] = VERSION + s.max_policy_lag + s.queue_grace + 1
    assert reasons(v.verify(honest, SENDER, as_of=VERSION)) == {"queue_expired"}
    now["v"] -= 1  # waited queue_grace versions past its lag limit: verified
    assert reasons(v.verify(honest, SENDER, as_of=VERSION + s.max_policy_lag)) == {"ok"}
    assert reasons(v.verify(honest, SENDER, as_of=VERSION)) == {"already_accepted"}
    assert PENALTIES["queue_expired"] == 0 and "queue_expired" in HONEST_MISTAKES


def test_9_replay_after_restart_rejected(kit, honest, tmp_path):
    """Finding 9: seen ids and used rounds survive a restart (SQLite, pruned by version)."""
    path = tmp_path / "seen.sqlite"
    v = verifier(kit, seen=SeenStore(path))
    assert reasons(v.verify(honest, SENDER)) == {"ok"}
    v.seen.close()
    again = verifier(kit, seen=SeenStore(path))  # a restarted node
    # the same batch (re-delivered, or replayed by anyone): a duplicate, not the sender's
    # doing (issue 30 finding 6); another batch for the round is still refused
    assert reasons(again.verify(honest, SENDER)) == {"already_accepted"}
    part = honest.model_copy(update={"completions": honest.completions[:3]})
    assert reasons(again.verify(part, SENDER)) == {"round_reused"}
    moved = honest.model_copy(update={"round": ROUND + 1})
    assert reasons(again.verify(moved, SENDER)) <= {"duplicate", "group_member_rejected",
                                                     "config_task_mix"}
    # the trainer moves on past the lag while stopped (or a replay comes late): the very
    # batch, now of a stale version, is still a re-delivery, never stale_policy against its
    # honest sender (issue 29 finding 4 / 30 finding 6, found hands-on); another batch for
    # the round is still refused
    lag = again.settings.max_policy_lag
    later = verifier(kit, seen=again.seen, latest_version=lambda: VERSION + lag + 3)
    later.seen.prune(VERSION + 3)  # what the trainer prunes at that version
    assert later.seen.counts()[0] == 0  # the ids of versions no verifier accepts: forgotten
    assert reasons(later.verify(honest, SENDER)) == {"already_accepted"}
    assert reasons(later.verify(part, SENDER)) == {"stale_policy"}
    later.seen.prune(VERSION + 1 + ROUND_MEMORY)  # its rounds too, ROUND_MEMORY later
    assert later.seen.counts() == (0, 0)


def test_10_spot_checks_per_group_mark_everything_seen(kit, honest):
    """Finding 10: a skipped group passes the cheap checks only, carries no logprobs,
    and its ids and round are remembered like checked ones."""
    v = verifier(kit)
    decided = []

    def spot(ids):
        decided.append(ids)
        return len(decided) == 1  # check the first group, skip the second

    results = v.verify(honest, SENDER, spot_check=spot)
    assert len(decided) == 2  # one decision per task group, not per batch
    assert [r.reason for r in results] == ["ok"] * 3 + ["unchecked"] * 3
    assert all(r.logprobs is None for r in results[3:])
    assert reasons(v.verify(honest, SENDER)) == {"already_accepted"}
    assert all(v.seen.seen(r.rollout_id) for r in results)


def test_10_forged_group_behind_honest_rollouts_rejected_whole(kit, honest):
    """A group is used whole or not at all; the penalty goes to the forged completion."""
    model, tokenizer, _ = kit
    forged = attacks.tamper_tokens(honest, random.Random(4), len(tokenizer),
                                   {tokenizer.eos_token_id}, model=model, tokenizer=tokenizer)
    comps = list(honest.completions)
    comps[1] = forged.completions[1]
    results = verifier(kit).verify(honest.model_copy(update={"completions": comps}), SENDER)
    assert [r.reason for r in results[:3]] == ["group_member_rejected", "token_mismatch",
                                               "group_member_rejected"]
    assert [r.reason for r in results[3:]] == ["ok"] * 3


def test_11_no_cherry_picking(kit, honest):
    """Finding 11: a sender may not drop seeds, pick tasks past tasks_per_round, pick
    round numbers, or send more rounds than the version's window holds."""
    # dropping the worst completion of a group
    kept = honest.model_copy(update={"completions": honest.completions[:5]})
    res = verifier(kit).verify(kept, SENDER)
    assert [r.reason for r in res[3:]] == ["incomplete_group"] * 2
    # a task past the first tasks_per_round of the draw
    third = sample(kit, tasks=3, n=3, round_=ROUND + 1)
    res = verifier(kit).verify(third, SENDER)
    assert {r.reason for r in res[6:]} == {"config_task_mix"}
    # a round from another version's window, and the window itself is finite
    assert reasons(verifier(kit).verify(honest.model_copy(update={"round": 0}), SENDER)) \
        == {"round_out_of_range"}
    assert list(RULES.round_window(VERSION)) == [12, 13, 14, 15]


# 12: cheap checks first ----------------------------------------------------------------------


def test_12_bogus_batch_costs_no_forward_pass(kit, honest):
    """Random tokens with a 1-byte proof are rejected before any model compute."""
    model, tokenizer, _ = kit
    calls = []
    hook = model.get_decoder().register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        bogus = attacks.bogus_batch(honest, random.Random(5), len(tokenizer), proof=b"\x01")
        assert reasons(verifier(kit).verify(bogus, SENDER)) <= {"proof_length",
                                                                "group_member_rejected"}
        assert calls == []
        # with a proof of the right length the same junk does cost a prefill (and fails)
        sized = attacks.bogus_batch(honest, random.Random(5), len(tokenizer),
                                    hidden_size=model.config.hidden_size, tokenizer=tokenizer)
        assert not any(r.accept for r in verifier(kit).verify(sized, SENDER))
        assert calls
    finally:
        hook.remove()


def test_fair_queue_keeps_established_peers_served_under_a_fresh_key_flood():
    from swarm_node.verifier.intake import Budget, IntakeLimits, VerificationQueue

    honest = {"h1", "h2"}
    q = VerificationQueue(lambda s: s in honest, IntakeLimits(max_probation=8),
                          rng=random.Random(0))
    served = []
    for step in range(200):
        for k in range(20):  # 20 fresh keys per honest batch
            q.put(f"sybil-{step}-{k}", "bogus")
        q.put("h1" if step % 2 else "h2", "honest")
        served.append(q.get())
    honest_served = sum(1 for s, _ in served if s in honest)
    assert honest_served >= 0.75 * len(served)  # probation share is 0.2
    assert len(q) <= 8 + 8 and q.dropped["probation_evicted"] > 3000
    budget = Budget(IntakeLimits(probation_tokens=100, window_s=60), clock=lambda: 0.0)
    assert budget.charge("new", 80, established=False)
    assert budget.charge("new", 80, established=False)  # the credit may be overdrawn once
    assert not budget.charge("new", 80, established=False)
    assert budget.charge("old", 10_000, established=True)


def test_12_shared_prompt_prefill_matches_the_full_prefill(kit, honest):
    """One prompt pass per group with its KV cache repeated gives the rows a full prefill
    of every prompt + completion gives (to float rounding), in sub-batches too."""
    from swarm_node.verifier.prefill import prefill, prefill_group

    model, tokenizer, _ = kit
    group = honest.completions[:3]
    pairs = [(c.prompt_ids.to_numpy(), c.completion_ids.to_numpy()) for c in group]
    full = [h for h, _ in prefill(model, pairs, tokenizer.pad_token_id, with_logits=False)]
    for budget in (8192, 1):
        shared = prefill_group(model, pairs[0][0], [c for _, c in pairs],
                               tokenizer.pad_token_id, budget)
        for a, b in zip(shared, full):
            assert a.shape == b.shape
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
