"""External group selection and re-scoring details."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from swarm_node.node.errors import NodeError
from swarm_node.node.models import load_model
from swarm_node.node.trainer.buffer import CompletionRecord, RolloutGroup
from swarm_node.node.trainer.mixing import ExternalText, Rescorer, select_groups

from .helpers import ref, right_and_wrong


def g(name: int, rewards: list[float]) -> RolloutGroup:
    return RolloutGroup("external", {"index": name}, [1],
                        [CompletionRecord([2], r) for r in rewards], id=name)


def test_selection_skips_zero_advantage_and_respects_k():
    groups = [g(0, [1, 1]), g(1, [0, 1]), g(2, [0, 0]), g(3, [0.5, 0.6])]
    rng = random.Random(0)
    for mode in ("uniform", "variance"):
        assert {x.id for x in select_groups(groups, 10, mode, rng)} == {1, 3}
        picked = select_groups(groups, 1, mode, rng)
        assert len(picked) == 1 and picked[0].id in {1, 3}
    assert select_groups(groups, 0, "uniform", rng) == []


def test_uniform_vs_variance_preference():
    # group 1 has reward std 0.5, group 2 std 0.05: variance mode prefers group 1 ~10:1
    groups = [g(1, [0, 1]), g(2, [0.45, 0.55])]
    rng = random.Random(1)
    uni = Counter(select_groups(groups, 1, "uniform", rng)[0].id for _ in range(2000))
    var = Counter(select_groups(groups, 1, "variance", rng)[0].id for _ in range(2000))
    assert 800 < uni[1] < 1200
    assert var[1] > 1700
    with pytest.raises(NodeError):
        select_groups(groups, 1, "nonsense", rng)


def test_rescorer_rejects_unusable_text(tiny_model_dir):
    _, tok = load_model(tiny_model_dir)
    resc = Rescorer(tok, max_context=64)
    r = ref(11)
    good, bad = right_and_wrong(r)
    unknown = ref(0, dataset="toy/no_such_family")
    texts = [ExternalText(r, good, "eos"), ExternalText(r, bad, "length"),
             ExternalText(r, "", "length"),          # empty: nothing to train on
             ExternalText(r, "9" * 500, "length"),   # longer than the context
             ExternalText(unknown, good, "eos")]     # task cannot be regenerated
    groups, rejected = resc.groups(texts, "peer", 3, received_version=7, temperature=0.7)
    assert rejected == 3
    (grp,) = groups
    assert grp.rewards == [1.0, 0.0] and grp.received_version == 7
    assert grp.completions[0].completion_ids[-1] == tok.eos_token_id
    assert grp.completions[1].completion_ids[-1] != tok.eos_token_id  # ended by length
    assert grp.temperature == 0.7 and grp.policy_id == "peer"
