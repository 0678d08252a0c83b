"""Typed trainer data: groups from local samples and from a verified batch, rows."""

from __future__ import annotations

import math

import numpy as np
import pytest
from swarm_node.node.models import load_model
from swarm_node.node.tasks import get_task
from swarm_node.node.trainer.data import (
    TrainRow,
    groups_from_samples,
    groups_from_verified_batch,
    rows_of,
)
from swarm_node.protocol.messages import Completion, RolloutBatch, SamplingParams, TensorData

from .helpers import ref, right_and_wrong, samples


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return load_model(tiny_model_dir)[1]


def _score(r, text):
    return 1.0 if text == get_task(r).answer else 0.0


def _decode(tok):
    return lambda ids: tok.decode(ids, skip_special_tokens=True)


def test_local_samples_text_and_reward_come_from_the_token_ids(tok):
    r = ref(3)
    good, bad = right_and_wrong(r)
    items = samples(tok, r, [good, bad, good, bad], version=2)
    items[1].text = good  # a wrong claim in the text field must not earn the reward
    groups = groups_from_samples(items, decode=_decode(tok), score=_score, policy_id="me",
                                 received_version=5, temperature=0.8)
    (g,) = groups
    assert g.rewards == [1.0, 0.0, 1.0, 0.0]
    assert [c.text for c in g.completions] == [good, bad, good, bad]
    assert (g.source, g.policy_id, g.policy_version, g.received_version, g.temperature) == \
        ("local", "me", 2, 5, 0.8)
    assert g.completions[0].logprobs == [-2.0] * len(items[0].completion_ids)


def _batch(tok, r, texts, logprobs) -> RolloutBatch:
    prompt = np.asarray(samples(tok, r, ["a"])[0].prompt_ids, "int32")
    comps = []
    for j, (text, lp) in enumerate(zip(texts, logprobs)):
        ids = np.asarray(tok.encode(text, add_special_tokens=False) + [tok.eos_token_id],
                         "int32")
        comps.append(Completion(task=r, prompt_ids=TensorData.from_numpy(prompt),
                                completion_ids=TensorData.from_numpy(ids),
                                logprobs=TensorData.from_numpy(np.full(len(ids), lp, "float32")),
                                finish_reason="eos", seed=j, claimed_reward=1.0,
                                text="claimed"))
    return RolloutBatch(swarm_id="s", round=0, policy_id="me", policy_version=4,
                        sampling=SamplingParams(temperature=0.9), completions=comps)


def test_verified_batch_uses_recomputed_logprobs_and_own_scoring(tok):
    r = ref(4)
    good, bad = right_and_wrong(r)
    batch = _batch(tok, r, [good, bad], [-1.25, math.nan])
    (g,) = groups_from_verified_batch(batch, decode=_decode(tok), score=_score,
                                      received_version=6)
    assert g.rewards == [1.0, 0.0]  # the sender's claimed reward and text are ignored
    assert [c.text for c in g.completions] == [good, bad]
    assert g.completions[0].logprobs == [-1.25] * len(g.completions[0].completion_ids)
    assert g.completions[1].logprobs is None  # NaN: unchecked, recompute
    assert (g.policy_version, g.received_version, g.temperature) == (4, 6, 0.9)


def test_rows_carry_group_advantages(tok):
    r = ref(5)
    good, bad = right_and_wrong(r)
    groups = groups_from_samples(samples(tok, r, [good, bad, bad, bad]), decode=_decode(tok),
                                 score=_score, policy_id="me", received_version=0,
                                 temperature=1.0)
    rows = rows_of(groups)
    assert all(isinstance(x, TrainRow) for x in rows) and len(rows) == 4
    assert rows[0].advantage == pytest.approx(math.sqrt(3), rel=1e-4)
    assert rows[1].advantage == pytest.approx(-1 / math.sqrt(3), rel=1e-4)
    assert [x.reward for x in rows] == [1.0, 0.0, 0.0, 0.0]
