"""Issue 11 item 12 (cost): the cheaper model checks decide exactly what the full ones do.

- replay pruning (`noisy_top2`): the seeded noise is computed only for tokens that can reach
  the top two; values, indices and verdicts equal the full-vocabulary computation;
- the prompt cache (`PromptCache`): a prompt prefix shared with an earlier prompt of the same
  model version is not recomputed; the hidden states match a full prompt pass;
- the LM head over several completions at once (`_group_logits`): each gets its own rows.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch
from swarm_node.node.testing import attacks
from swarm_node.protocol import noise
from swarm_node.protocol.messages import SamplingParams
from swarm_node.verifier import checks
from swarm_node.verifier.checks import RolloutVerifier, noisy_top2
from swarm_node.verifier.prefill import PromptCache, prefill_group

pytestmark = pytest.mark.usefixtures("one_thread")  # kit, one_thread: conftest.py
SENDER = "12D3KooWHonestInferencePeer"


def full_top2(scores, seeds, positions):
    """The reference: noise for every token of every row."""
    best = (scores + noise.gumbel(seeds, positions, scores.shape[-1])).topk(2, dim=-1)
    return best.values, best.indices


def rows(scores):
    t = scores.shape[0]
    return torch.full((t,), 987654321, dtype=torch.int64), torch.arange(t, dtype=torch.int64)


@pytest.mark.parametrize("scale", [1.0, 4.0, 12.0])
def test_noisy_top2_equals_the_full_computation(scale, monkeypatch):
    gen = torch.Generator().manual_seed(int(scale))
    scores = torch.randn(24, 8192, generator=gen) * scale
    scores[1, 100:] = float("-inf")  # top-p truncation
    scores[2, 1:] = float("-inf")  # a single token left: L = -inf keeps the whole row
    scores[3, 5:7] = scores[3, 5:7].max()  # an exact tie
    hashed = []
    real = noise.mantissas
    monkeypatch.setattr(noise, "mantissas", lambda *a, **k: hashed.append(
        real(*a, **k).numel()) or real(*a, **k))
    values, indices = noisy_top2(scores, *rows(scores))
    monkeypatch.undo()
    want_values, want_indices = full_top2(scores, *rows(scores))
    assert torch.equal(values, want_values)
    assert torch.equal(indices[:, 0], want_indices[:, 0])
    assert torch.equal(indices[[0, *range(4, 24)], 1], want_indices[[0, *range(4, 24)], 1])
    if scale >= 12.0:  # wide logits: most of the vocabulary cannot win and is not hashed
        assert sum(hashed) < 0.5 * scores.numel()


def test_noisy_top2_keeps_nan_on_top():
    scores = torch.randn(3, 4096)
    scores[1, 7] = float("nan")
    values, _ = noisy_top2(scores, *rows(scores))
    assert torch.isnan(values[1, 0]) and not torch.isnan(values[[0, 2]]).any()


@pytest.mark.parametrize("top_p", [0.1, 0.5, 0.9, 0.95, 0.9999])
def test_top_p_masks_keep_what_the_full_sort_keeps(top_p):
    """Same kept set as mask_logits' full sort, except where float32 rounding of a long
    cumulative sum decides: deep-tail tokens within 1e-5 of the top-p mass (a tie that the
    sampler's own logits, a few ulps away from the verifier's, decide either way too)."""
    from swarm_node.node.sampler.seeded import mask_logits
    from swarm_node.verifier.checks import top_p_masks

    gen = torch.Generator().manual_seed(7)
    scores = torch.randn(16, 8192, generator=gen) * torch.linspace(0.5, 8, 16)[:, None]
    scores[0, 50:] = float("-inf")  # after a top-k
    loose_p = min(1.0, top_p + 1e-4)
    strict, loose, off = top_p_masks(scores, top_p, loose_p, 1.0)
    assert off is scores
    for got, p in ((strict, top_p), (loose, loose_p)):
        want = torch.isfinite(mask_logits(scores, SamplingParams(top_p=p)))
        differ = torch.isfinite(got) != want
        if p <= 0.95:
            assert not differ.any()
        for r, v in differ.nonzero().tolist():
            ordered, order = torch.sort(scores[r], descending=True)
            probs = torch.softmax(ordered, dim=-1)
            before = (torch.cumsum(probs, dim=-1) - probs)[(order == v).nonzero().item()]
            assert abs(float(before) - p) < 1e-5


def test_replay_masks_allow_for_the_top_p_cut_moving():
    """Replay's top-p masks (checks._masks): the claimed token may be any token the sampler
    may have had (top_p + top_p_eps, and tokens within tie_eps below that cut: honest floats
    reorder scores that close), the best is taken over the tokens it surely had (top_p -
    top_p_eps, counting tokens within tie_eps below each as ahead of it); top-k still
    applies; without top-p both are the top-k mask."""
    from swarm_node.verifier.checks import _masks

    scores = torch.full((1, 64), -6.0)
    scores[0, :5] = torch.tensor([5.0, 3.0, 2.9, 2.7, 2.4])
    probs = torch.softmax(scores[0], dim=-1)
    top_p = float(probs[0] + probs[1] / 2)  # the exact cut keeps tokens 0 and 1
    params = SamplingParams(temperature=1.0, top_p=top_p)

    def kept(mask):
        return torch.isfinite(mask[0]).nonzero()[:, 0].tolist()

    tight, loose = _masks(scores, params, 1e-4, 0.4)
    # token 1 is not surely kept: token 2 (0.1 below it) may have been ahead of it
    assert kept(tight) == [0] and kept(loose) == [0, 1, 2, 3]
    tight, loose = _masks(scores, params, 1e-4, 0.0)
    assert kept(tight) == kept(loose) == [0, 1]
    # tokens 2 and 3 are within 0.4 of the cut, but top-k 2 dropped them
    top_k = SamplingParams(temperature=1.0, top_p=0.999, top_k=2)
    assert [kept(m) for m in _masks(scores, top_k, 1e-4, 0.4)] == [[0, 1], [0, 1]]
    tight, loose = _masks(scores, SamplingParams(temperature=1.0, top_p=1.0), 1e-4, 0.4)
    assert loose is tight and kept(loose) == list(range(64))


def verdicts(results):
    keys = ("replay_max_gap", "ties", "tie_flips", "wide_ties", "wide_flips")
    return [(r.reason, tuple(r.stats.get(k) for k in keys)) for r in results]


def test_pruned_replay_keeps_every_verdict(kit, monkeypatch):
    """Honest batches (T = 1, and T = 0.7 with top-p 0.9) and forgeries get the same verdicts
    and replay statistics with and without the pruning. The tiny model's logits are nearly
    flat (nothing could be pruned), so its head is sharpened x40: logit spreads like a real
    model's, where most of the vocabulary cannot win."""
    base, tokenizer, source = kit
    model = copy.deepcopy(base)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(40.0)
    batches = []
    for r, params in enumerate([SamplingParams(temperature=1.0, max_new_tokens=16),
                                SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=16)]):
        honest = attacks.sample_batch(model, tokenizer, source, SENDER, params=params,
                                      version=0, round_=r, tasks=2, n=2)
        forged = attacks.tamper_tokens(honest, random.Random(r), len(tokenizer),
                                       {tokenizer.eos_token_id}, model=model,
                                       tokenizer=tokenizer)
        batches += [honest, forged]

    def run():
        out = []
        for b in batches:
            v = RolloutVerifier(model, tokenizer, source, swarm_id="default",
                                latest_version=lambda: 0)
            out.append(verdicts(v.verify(b, SENDER)))
        return out

    hashed = []
    real = noise.mantissas
    monkeypatch.setattr(noise, "mantissas", lambda *a, **k: hashed.append(
        real(*a, **k).numel()) or real(*a, **k))
    monkeypatch.setattr(checks, "DENSE_SHARE", 1.0)  # always the candidates' path
    pruned = run()
    monkeypatch.setattr(noise, "mantissas", real)
    full_rows = sum(c.completion_ids.shape[0] for b in batches for c in b.completions)
    assert sum(hashed) < 0.5 * full_rows * len(tokenizer)  # the pruning did prune
    monkeypatch.setattr(checks, "DENSE_SHARE", 0.0)  # always the row-blocked dense path
    assert run() == pruned
    monkeypatch.setattr(checks, "noisy_top2", full_top2)
    assert run() == pruned
    reasons = {r for batch in pruned for r, _ in batch}
    assert "ok" in reasons and "token_mismatch" in reasons


def test_prompt_cache_reuses_a_shared_prefix(kit):
    model, _, _ = kit
    rng = random.Random(0)
    prefix = [rng.randrange(3, 200) for _ in range(24)]
    prompts = [prefix + [rng.randrange(3, 200) for _ in range(k)] for k in (5, 9)]
    comps = [[rng.randrange(3, 200) for _ in range(n)] for n in (6, 1, 11)]
    cache = PromptCache(min_prefix=16)
    for p in prompts:
        prefill_group(model, p, comps, prompt_cache=cache, version=3)
    assert (cache.hits, cache.misses, cache.tokens_saved) == (1, 1, 24)
    # the cached path gives the full prompt pass's hidden states
    want = prefill_group(model, prompts[1], comps)
    got = prefill_group(model, prompts[1], comps, prompt_cache=cache, version=3)
    assert cache.tokens_saved == 24 + len(prompts[1]) - 1  # the same prompt: all but its last
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
    # another version or another model object never reuses the entries
    prefill_group(model, prompts[0], comps, prompt_cache=cache, version=4)
    prefill_group(copy.deepcopy(model), prompts[0], comps, prompt_cache=cache, version=3)
    assert cache.misses == 3


def test_packed_completions_match_one_prefill_each(kit):
    """Completions of very different lengths run packed end to end after the prompt (no
    padding); each row is what its completion alone gives, so no completion sees another's
    tokens (a leak through the mask would change the rows), also split into packs."""
    from swarm_node.verifier import prefill as pf

    model, _, _ = kit
    rng = random.Random(1)
    prompt = [rng.randrange(3, 200) for _ in range(12)]
    comps = [[rng.randrange(3, 200) for _ in range(n)] for n in (24, 5, 22, 1, 6)]
    fed = [[c[:-1] for c in comps]]
    assert pf._packs(fed, [len(prompt)], 8192) == [[(0, i) for i in range(5)]]
    assert pf._packs(fed, [len(prompt)], 30) == [[(0, 0)], [(0, 1)], [(0, 2)], [(0, 3), (0, 4)]]
    alone = [prefill_group(model, prompt, [c])[0] for c in comps]
    for budget in (8192, 30):
        packed = prefill_group(model, prompt, comps, token_budget=budget)
        for got, want, c in zip(packed, alone, comps):
            assert got.shape[0] == len(c)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_groups_packed_together_match_each_group_alone(kit):
    """Several task groups in one pass (their prompt caches side by side, some prompts
    sharing a cached prefix): every completion's rows are its group's alone."""
    from swarm_node.verifier.prefill import prefill_groups

    model, _, _ = kit
    rng = random.Random(2)
    prefix = [rng.randrange(3, 200) for _ in range(20)]
    prompts = [prefix + [rng.randrange(3, 200) for _ in range(k)] for k in (3, 11, 7)]
    groups = [(p, [[rng.randrange(3, 200) for _ in range(rng.randrange(1, 15))]
                   for _ in range(3)]) for p in prompts]
    alone = [prefill_group(model, p, comps) for p, comps in groups]
    for budget in (8192, 45):
        together = prefill_groups(model, groups, budget, PromptCache(min_prefix=16), 0)
        for got_g, want_g in zip(together, alone):
            for got, want in zip(got_g, want_g):
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_prompt_cache_is_bounded_in_tokens(kit):
    model, _, _ = kit
    cache = PromptCache(max_tokens=50)
    for last in (7, 8, 9):  # three 22-token prompts: two fit in 50 tokens
        prefill_group(model, list(range(3, 24)) + [last], [[5, 6]], prompt_cache=cache)
    assert len(cache._entries) == 2 and sum(len(k[2]) for k in cache._entries) <= 50
    assert cache.hits == 2


def test_lm_head_in_blocks_gives_each_completion_its_own_logits(kit, monkeypatch):
    """The LM head runs over several completions' rows at once (blocks of LOGITS_BLOCK
    values); every completion still gets exactly its own rows, in order, and the verdicts,
    recomputed logprobs and statistics match one head call per completion."""
    model, tokenizer, source = kit
    vocab = model.get_output_embeddings().weight.shape[0]
    batch = attacks.sample_batch(model, tokenizer, source, SENDER, version=0, round_=5,
                                 tasks=2, n=3, params=SamplingParams(max_new_tokens=12))
    forged = attacks.tamper_tokens(batch, random.Random(3), len(tokenizer),
                                   {tokenizer.eos_token_id}, model=model, tokenizer=tokenizer)
    hiddens = [torch.randn(n, model.config.hidden_size, generator=torch.Generator()
                           .manual_seed(n)) for n in (5, 1, 12, 7, 3)]
    v = RolloutVerifier(model, tokenizer, source, swarm_id="default", latest_version=lambda: 0)
    monkeypatch.setattr(checks, "LOGITS_BLOCK", 13 * vocab)  # blocks of <= 13 rows
    calls = []
    real_logits = v._logits
    monkeypatch.setattr(v, "_logits", lambda m, h: calls.append(h.shape[0]) or real_logits(m, h))
    got = list(v._group_logits(model, hiddens))
    assert calls == [6, 12, 10]  # 5+1, 12 alone, 7+3
    for h, lg in zip(hiddens, got):
        torch.testing.assert_close(lg, real_logits(model, h), rtol=1e-5, atol=1e-5)
    monkeypatch.undo()

    def run(block):
        monkeypatch.setattr(checks, "LOGITS_BLOCK", block)
        out = []
        for b in (batch, forged):
            verifier = RolloutVerifier(model, tokenizer, source, swarm_id="default",
                                       latest_version=lambda: 0)
            out.append(verifier.verify(b, SENDER))
        return out

    one_each, together = run(vocab), run(1 << 30)
    for a_batch, b_batch in zip(one_each, together):
        assert [r.reason for r in a_batch] == [r.reason for r in b_batch]
        for a, b in zip(a_batch, b_batch):
            if a.logprobs is not None:
                assert abs(a.logprobs - b.logprobs).max() < 1e-5
            assert verdicts([a]) == verdicts([b])
    assert {r.reason for r in one_each[0]} == {"ok"}
    assert "token_mismatch" in {r.reason for r in one_each[1]}
