"""Issue 11 finding 1 on the real model (SmolLM2-135M-Instruct, CPU): honest fp32 and bf16
batches are accepted under the thresholds of their dtype, with the model's own EOS set and
context limit; a consistent forgery is still rejected. (Calibration across batch sizes,
threads and lengths: benchmarks/verifier.py --real, RESULTS.md "verifier-real".)"""

from __future__ import annotations

import random

import pytest
import torch
from swarm_node.node.testing import attacks
from swarm_node.protocol.messages import SamplingParams
from swarm_node.verifier.checks import RolloutVerifier

pytestmark = pytest.mark.slow
SENDER = "12D3KooWSmolPeer"
PARAMS = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=12)


@pytest.fixture(scope="module")
def source():
    from swarm_node.node.tasks import TaskSource

    torch.set_num_threads(1)
    return TaskSource({"rg/basic_arithmetic": 1.0, "toy/digit_copy": 1.0}, "default")


def check(model, tokenizer, source, dtype, batch):
    v = RolloutVerifier(model, tokenizer, source, swarm_id="default",
                        latest_version=lambda: 0, dtype=dtype, max_context=1 << 20)
    return v.verify(batch.model_copy(update={"dtype": dtype}), SENDER)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_honest_real_model_batch_accepted_in_its_dtype(smollm2_dir, source, dtype):
    from swarm_node.node.models import load_model

    model, tokenizer = load_model(smollm2_dir, dtype=dtype)
    # one task's group per generate call: the 36-token prompt is not left-padded to the
    # 118-token one (a CPU without bf16 units pays ~5x fp32 per bf16 prefill row)
    batch = attacks.sample_batch(model, tokenizer, source, SENDER, round_=0, version=0,
                                 tasks=2, n=2, params=PARAMS, max_batch=2)
    results = check(model, tokenizer, source, dtype, batch)
    assert [r.reason for r in results] == ["ok"] * 4, [(r.reason, r.detail) for r in results]
    if dtype == "float32":
        forged = attacks.tamper_tokens(batch, random.Random(0), len(tokenizer),
                                       {tokenizer.eos_token_id}, model=model,
                                       tokenizer=tokenizer)
        assert not any(r.accept for r in check(model, tokenizer, source, dtype, forged))
