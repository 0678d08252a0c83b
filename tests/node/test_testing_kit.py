"""The demo's cheater (node/testing/dishonest.py). That verifiers reject and ban it end to end
is proven by tests/integration/test_swarm.py; these check what it sends."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from swarm_node.node.errors import NodeError
from swarm_node.node.tasks import get_task
from swarm_node.node.testing.dishonest import make_dishonest, tamper
from swarm_node.protocol.messages import RolloutBatch, SamplingParams, TaskRef
from transformers import AutoTokenizer

from ..protocol.examples import PEER, completion


def batch() -> RolloutBatch:
    ref = TaskRef(dataset="toy/digit_successor", params={}, seed=42, index=5)
    comps = [completion(3, 1).model_copy(update={"task": ref, "claimed_reward": 0.0})]
    return RolloutBatch(swarm_id="demo", round=0, policy_id=PEER, policy_version=0,
                        sampling=SamplingParams(), completions=comps)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_tamper_tokens_sends_the_answer(tokenizer):
    honest = batch()
    cheat = tamper(honest, "tamper_tokens", tokenizer).completions[0]
    answer = get_task(honest.completions[0].task).answer
    ids = cheat.completion_ids.to_numpy().tolist()
    assert ids == tokenizer.encode(answer, add_special_tokens=False) + [tokenizer.eos_token_id]
    assert cheat.text == answer and cheat.claimed_reward == 1.0
    assert not np.any(cheat.logprobs.to_numpy())
    assert cheat.proof == honest.completions[0].proof  # the honest proof is kept


def test_forge_reward_keeps_tokens(tokenizer):
    honest = batch()
    cheat = tamper(honest, "forge_reward", tokenizer).completions[0]
    assert cheat.claimed_reward == 1.0
    assert cheat.completion_ids == honest.completions[0].completion_ids


def test_make_dishonest_installs_on_inference_roles_only(tokenizer):
    role = SimpleNamespace(name="inference", outgoing=None, tokenizer=tokenizer)
    make_dishonest(role, "forge_reward")
    assert role.outgoing(batch()).completions[0].claimed_reward == 1.0
    with pytest.raises(NodeError, match="only an inference peer"):
        make_dishonest(SimpleNamespace(name="trainer"), "forge_reward")
    with pytest.raises(ValueError):
        make_dishonest(role, "lie")
