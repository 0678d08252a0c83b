"""HF sampler on the real tiny model: shapes, logprobs, hidden states, seeded replay,
batch independence, weight reload, bad input."""

from __future__ import annotations

import pytest
import torch
from swarm_node.node.errors import NodeError
from swarm_node.node.models import build_tiny_model, load_model
from swarm_node.node.sampler.hf import HFSampler
from swarm_node.node.sampler.seeded import (
    choose_tokens,
    completion_seed,
    gumbel_noise,
    mask_logits,
)
from swarm_node.node.tasks import TaskSource, format_prompt, get_task
from swarm_node.protocol.messages import SamplingParams, TaskRef


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    return load_model(tiny_model_dir)


@pytest.fixture()
def sampler(loaded):
    model, tok = loaded
    return HFSampler(model, tok, peer_id="peer-a")


def _prompts(tok, mix=None, n=3, round=0):
    src = TaskSource(mix or {"toy/digit_successor": 1.0, "rg/basic_arithmetic": 1.0}, "s")
    return [(ref, format_prompt(tok, get_task(ref))) for ref in src.draw("peer-a", round, n)]


def choose_token(logits, seed: int, position: int, params) -> tuple[int, float]:
    """(token, logprob) for one row of logits [V] at completion position `position`: the
    sampler's seeded choice, one token at a time (the replay a verifier could do)."""
    tokens, logprobs = choose_tokens(logits.unsqueeze(0), [seed], [position], params)
    return int(tokens[0]), float(logprobs[0])


def _forward(model, sample):
    """Logprob-ready logits and final-norm hidden states from one separate prefill."""
    ids = torch.tensor([sample.prompt_ids + sample.completion_ids])
    p, t = len(sample.prompt_ids), len(sample.completion_ids)
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    return out.logits[0, p - 1:p + t - 1].float(), out.hidden_states[-1][0, p - 1:p + t - 1]


def test_shapes_and_fields(sampler, loaded):
    model, tok = loaded
    prompts = _prompts(tok)
    params = SamplingParams(temperature=1.0, max_new_tokens=12)
    out = sampler.generate(prompts, 4, params)
    assert len(out) == 3 and all(len(row) == 4 for row in out)
    for (ref, ids), row in zip(prompts, out):
        for j, s in enumerate(row):
            assert s.task == ref and s.prompt_ids == ids
            assert 1 <= len(s.completion_ids) <= 12
            assert s.logprobs.dtype == torch.float32 and s.logprobs.shape == (len(s.completion_ids),)
            assert torch.all(s.logprobs <= 0)
            assert s.hidden.dtype == torch.float32
            assert s.hidden.shape == (len(s.completion_ids), model.config.hidden_size)
            assert s.seed == completion_seed(ref, "peer-a", 0, j)
            assert s.policy_version == 0
            assert s.text == tok.decode(s.completion_ids, skip_special_tokens=True)
            if s.finish_reason == "length":
                assert len(s.completion_ids) == 12
            else:
                assert s.completion_ids[-1] == tok.eos_token_id
    # distinct seeds give distinct completions
    assert len({tuple(s.completion_ids) for row in out for s in row}) > 6


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_logprobs_and_hidden_match_a_separate_forward(sampler, loaded, temperature):
    model, tok = loaded
    out = sampler.generate(_prompts(tok), 2, SamplingParams(temperature=temperature,
                                                             max_new_tokens=10))
    for row in out:
        for s in row:
            logits, hidden = _forward(model, s)
            scale = temperature if temperature > 0 else 1.0
            expect = torch.log_softmax(logits / scale, -1).gather(
                -1, torch.tensor(s.completion_ids)[:, None])[:, 0]
            torch.testing.assert_close(s.logprobs, expect, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(s.hidden, hidden, atol=1e-4, rtol=1e-4)


def test_seeded_replay_token_by_token(sampler, loaded):
    """What a verifier does: one prefill, then replay every token from (seed, position)."""
    model, tok = loaded
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, max_new_tokens=10)
    out = sampler.generate(_prompts(tok), 3, params)
    for row in out:
        for s in row:
            logits, _ = _forward(model, s)
            for t, token in enumerate(s.completion_ids):
                replayed, lp = choose_token(logits[t], s.seed, t, params)
                assert replayed == token
                assert lp == pytest.approx(float(s.logprobs[t]), abs=1e-4)
    # a different seed would have chosen differently somewhere
    s = out[0][0]
    logits, _ = _forward(model, s)
    other = [choose_token(logits[t], s.seed + 1, t, params)[0] for t in range(len(logits))]
    assert other != s.completion_ids


def test_generation_repeats_and_is_batch_independent(sampler, loaded):
    model, tok = loaded
    prompts = _prompts(tok, n=4)
    params = SamplingParams(temperature=1.0, max_new_tokens=10)
    seeds = [[11, 12], [13, 14], [15, 16], [17, 18]]
    batched = sampler.generate(prompts, 2, params, seeds=seeds)
    again = sampler.generate(prompts, 2, params, seeds=seeds)
    alone = sampler.generate(prompts[2:3], 1, params, seeds=[[16]])
    assert [[s.completion_ids for s in row] for row in batched] == \
        [[s.completion_ids for s in row] for row in again]
    # the same completion alone (no padding) and inside a left-padded batch
    assert alone[0][0].completion_ids == batched[2][1].completion_ids
    torch.testing.assert_close(alone[0][0].logprobs, batched[2][1].logprobs,
                               atol=1e-4, rtol=1e-4)
    small = HFSampler(model, tok, max_batch=3)  # rows split across sub-batches
    split = small.generate(prompts, 2, params, seeds=seeds)
    assert [[s.completion_ids for s in row] for row in split] == \
        [[s.completion_ids for s in row] for row in batched]


def test_top_k_one_is_greedy(sampler, loaded):
    _, tok = loaded
    prompts = _prompts(tok)
    greedy = sampler.generate(prompts, 1, SamplingParams(temperature=0.0, max_new_tokens=8))
    topk1 = sampler.generate(prompts, 2, SamplingParams(temperature=1.3, top_k=1,
                                                       max_new_tokens=8))
    for g, row in zip(greedy, topk1):
        assert all(s.completion_ids == g[0].completion_ids for s in row)


def test_stops_at_eos(loaded):
    model, tok = loaded
    prompts = _prompts(tok, n=2)
    s = HFSampler(model, tok)
    first = s.generate(prompts, 1, SamplingParams(temperature=0.0, max_new_tokens=8))
    stop_token = first[0][0].completion_ids[2]
    s.eos_ids = {stop_token}  # pretend this token is EOS: generation must stop right there
    stopped = s.generate(prompts, 1, SamplingParams(temperature=0.0, max_new_tokens=8))
    sample = stopped[0][0]
    assert sample.finish_reason == "eos"
    assert sample.completion_ids[-1] == stop_token
    assert sample.completion_ids == first[0][0].completion_ids[:sample.completion_ids.index(
        stop_token) + 1]


def test_weight_reload_changes_outputs_and_version(tmp_path, tiny_model_dir):
    model, tok = load_model(tiny_model_dir)
    s = HFSampler(model, tok)
    prompts = _prompts(tok)
    params = SamplingParams(temperature=1.0, max_new_tokens=8)
    seeds = [[1], [2], [3]]  # the default seeds depend on the version
    before = s.generate(prompts, 1, params, seeds=seeds)
    build_tiny_model(tmp_path / "other", seed=1)
    s.load_weights(tmp_path / "other")
    assert s.version == 1
    after = s.generate(prompts, 1, params, seeds=seeds)
    assert all(row[0].policy_version == 1 for row in after)
    assert [r[0].completion_ids for r in after] != [r[0].completion_ids for r in before]
    assert not torch.allclose(after[0][0].logprobs[:1], before[0][0].logprobs[:1])
    # back to the first weights, from a state dict, with an explicit version
    original, _ = load_model(tiny_model_dir)
    s.load_weights(original.state_dict(), version=7)
    assert s.version == 7
    restored = s.generate(prompts, 1, params, seeds=seeds)
    assert [r[0].completion_ids for r in restored] == [r[0].completion_ids for r in before]
    torch.testing.assert_close(restored[0][0].logprobs, before[0][0].logprobs)


def test_bad_checkpoints_leave_the_sampler_unchanged(tmp_path, loaded):
    model, tok = loaded
    s = HFSampler(model, tok, version=3)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(NodeError, match="corrupt"):
        s.load_weights(corrupt)
    with pytest.raises(NodeError, match="no .safetensors"):
        s.load_weights(tmp_path)
    bad_shape = dict(state)
    bad_shape["model.norm.weight"] = torch.ones(3)
    with pytest.raises(NodeError, match="model.norm.weight"):
        s.load_weights(bad_shape)
    extra = dict(state, **{"bogus.weight": torch.ones(1)})
    with pytest.raises(NodeError, match="bogus.weight"):
        s.load_weights(extra)
    missing = {k: v for k, v in state.items() if k != "model.norm.weight"}
    with pytest.raises(NodeError, match="lacks"):
        s.load_weights(missing)
    assert s.version == 3
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k])


def test_long_prompts_and_context(loaded):
    model, tok = loaded
    ref = TaskRef(dataset="toy/digit_copy", seed=0, index=0)
    s = HFSampler(model, tok, max_context=40)
    with pytest.raises(NodeError, match="40"):
        s.generate([(ref, [5] * 40)], 1, SamplingParams(max_new_tokens=4))
    with pytest.raises(NodeError, match="empty"):
        s.generate([(ref, [])], 1, SamplingParams(max_new_tokens=4))
    # a prompt near the end of the context gets only the tokens that fit
    out = s.generate([(ref, [5] * 36)], 1, SamplingParams(temperature=0.0, max_new_tokens=10))
    assert len(out[0][0].completion_ids) <= 4
    with pytest.raises(NodeError, match="seeds"):
        s.generate([(ref, [5, 6])], 2, SamplingParams(), seeds=[[1]])


def test_seed_derivation_and_noise():
    ref = TaskRef(dataset="toy/digit_copy", seed=1, index=2)
    base = completion_seed(ref, "p", 3, 0)
    assert base == completion_seed(TaskRef(dataset="toy/digit_copy", seed=1, index=2), "p", 3, 0)
    others = {completion_seed(ref, "p", 3, 1), completion_seed(ref, "q", 3, 0),
              completion_seed(ref, "p", 4, 0),
              completion_seed(TaskRef(dataset="toy/digit_copy", seed=1, index=3), "p", 3, 0)}
    assert base not in others and len(others) == 4
    assert 0 <= base < 2**63
    g = gumbel_noise(base, 5, 1000)
    assert torch.equal(g, gumbel_noise(base, 5, 1000))
    assert not torch.equal(g, gumbel_noise(base, 6, 1000))
    assert torch.isfinite(g).all() and abs(float(g.mean()) - 0.5772) < 0.15  # Euler-Mascheroni


def test_top_p_mask_keeps_the_nucleus():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    kept = torch.isfinite(mask_logits(logits, SamplingParams(top_p=0.7)))
    assert kept.tolist() == [True, True, False, False]
    kept = torch.isfinite(mask_logits(logits, SamplingParams(top_p=0.1)))
    assert kept.tolist() == [True, False, False, False]
    kept = torch.isfinite(mask_logits(logits, SamplingParams(top_k=3)))
    assert kept.tolist() == [True, True, True, False]


def test_factory_builds_the_hf_sampler_from_config(tiny_model_dir):
    from swarm_node.node.config import load_config
    from swarm_node.node.sampler import make_sampler, sampling_params

    cfg = load_config(overrides={"model.name": str(tiny_model_dir), "model.device": "cpu",
                                 "sampler.backend": "auto", "sampler.top_k": 5,
                                 "sampler.max_batch": 3})
    s = make_sampler(cfg, peer_id="peer-z")
    assert type(s).__name__ == "HFSampler" and s.peer_id == "peer-z" and s.max_batch == 3
    p = sampling_params(cfg)
    assert (p.top_k, p.max_new_tokens, p.temperature) == (5, 16, 1.0)


def test_backend_choice():
    from swarm_node.node.sampler.factory import choose_backend, vllm_available

    assert choose_backend("hf", "cpu") == "hf"
    assert choose_backend("auto", "cpu") == "hf"
    if not vllm_available():
        with pytest.raises(NodeError, match="vllm"):
            choose_backend("vllm", "cpu")
    with pytest.raises(NodeError, match="backend"):
        choose_backend("tpu", "cpu")


def test_a_round_uses_the_swarm_prompt_style(sampler, loaded):
    """Peers and verifiers rebuild prompts from the task and the swarm's prompt style: a
    round's prompts are exactly format_prompt(get_task(ref, style)) for its tasks."""
    from swarm_node.node.sampler.rounds import sample_round
    from swarm_node.node.tasks import PromptStyle

    _, tok = loaded
    src = TaskSource({"rg/basic_arithmetic": 1.0}, "s", params={
        "rg/basic_arithmetic": {"max_digits": 1, "max_terms": 2}})
    style = PromptStyle("direct", 2)
    params = SamplingParams(temperature=1.0, max_new_tokens=2)
    samples = sample_round(sampler, tok, src, "peer-a", 0, 2, 2, params, style=style)
    for s in samples:
        assert s.task.params == {"max_digits": 1, "max_terms": 2}
        assert s.prompt_ids == format_prompt(tok, get_task(s.task, style=style))
        assert s.prompt_ids != format_prompt(tok, get_task(s.task))  # the default style
