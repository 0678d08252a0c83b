"""GRPO advantages and the two-sided-clipped loss on hand-computed examples."""

from __future__ import annotations

import math

import pytest
import torch
from swarm_node.node.trainer.grpo import (
    LossConfig,
    group_advantages,
    has_signal,
    policy_loss,
    token_logprobs,
)


def test_group_advantages_hand_computed():
    # mean 0.5, population std 0.5 -> +-1 (up to eps)
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]))
    assert torch.allclose(adv, torch.tensor([1.0, -1.0, -1.0, 1.0]), atol=1e-5)
    # rewards 0, 0.5, 1: mean 0.5, std sqrt(1/6)=0.40825
    adv = group_advantages(torch.tensor([0.0, 0.5, 1.0]))
    s = math.sqrt(1 / 6)
    assert torch.allclose(adv, torch.tensor([-0.5 / s, 0.0, 0.5 / s]), atol=1e-4)
    # a constant group has zero advantage everywhere and no signal
    assert torch.equal(group_advantages(torch.tensor([0.3, 0.3])), torch.zeros(2))
    assert not has_signal([0.3, 0.3]) and not has_signal([1.0]) and has_signal([0.0, 1.0])


def _one_token(ratio: float, adv: float, cfg=None):
    """Loss and gradient wrt logp for one token with the given ratio and advantage."""
    logp = torch.tensor([[math.log(ratio)]], requires_grad=True)
    loss, stats = policy_loss(logp, torch.zeros(1, 1), torch.tensor([adv]),
                              torch.ones(1, 1), cfg)
    loss.backward()
    return float(loss.detach()), logp.grad.item(), stats


@pytest.mark.parametrize(
    "ratio, adv, want_loss, want_grad",
    [
        (1.0, 1.0, -1.0, -1.0),    # on-policy: plain policy gradient
        (1.2, 1.0, -1.2, -1.2),    # inside [0.8, 1.28]: unclipped
        (1.5, 1.0, -1.28, 0.0),    # A>0, ratio above 1+eps_high: clipped at 1.28, no grad
        (0.5, 1.0, -0.5, -0.5),    # A>0, small ratio: min picks the unclipped term
        (0.5, -1.0, 0.8, 0.0),     # A<0, ratio below 1-eps_low: clipped at 0.8, no grad
        (2.0, -1.0, 2.0, 2.0),     # A<0, large ratio: unclipped (PPO's unbounded side)
        (6.0, -1.0, 4.0, 0.0),     # A<0, ratio above delta=4: capped at delta, no grad
        (6.0, 2.0, -2.56, 0.0),    # A>0 above delta: the clip term (1.28*2) wins
    ],
)
def test_two_sided_clipping(ratio, adv, want_loss, want_grad):
    loss, grad, _ = _one_token(ratio, adv)
    assert loss == pytest.approx(want_loss, abs=1e-5)
    assert grad == pytest.approx(want_grad, abs=1e-5)


def test_clip_stats_and_configurable_bounds():
    _, _, stats = _one_token(0.5, -1.0)
    assert stats.clip_low_frac == 1.0 and stats.clip_high_frac == 0.0
    _, _, stats = _one_token(6.0, -1.0)
    assert stats.delta_frac == 1.0
    # a wider eps_high lets ratio 1.5 through unclipped
    loss, grad, _ = _one_token(1.5, 1.0, LossConfig(eps_high=0.6))
    assert loss == pytest.approx(-1.5) and grad == pytest.approx(-1.5)
    # delta 10 no longer caps ratio 6
    loss, _, _ = _one_token(6.0, -1.0, LossConfig(delta=10.0))
    assert loss == pytest.approx(6.0, abs=1e-4)


def test_token_level_aggregation():
    # completion 0 has 1 token (A=+1), completion 1 has 3 tokens (A=-1), all ratio 1:
    # token-level mean = (-1 + 3*1) / 4 = 0.5 (a per-sequence mean would give 0)
    logp = torch.zeros(2, 3)
    mask = torch.tensor([[1, 0, 0], [1, 1, 1]])
    loss, stats = policy_loss(logp, torch.zeros(2, 3), torch.tensor([1.0, -1.0]), mask)
    assert float(loss) == pytest.approx(0.5)
    assert stats.tokens == 4
    # padding positions never contribute, whatever their values
    logp_pad = logp.clone()
    logp_pad[0, 1:] = 5.0
    loss2, _ = policy_loss(logp_pad, torch.zeros(2, 3), torch.tensor([1.0, -1.0]), mask)
    assert float(loss2) == pytest.approx(0.5)


def test_kl_and_entropy_terms():
    logp = torch.log(torch.tensor([[0.5]]))
    ref = torch.log(torch.tensor([[0.25]]))
    cfg = LossConfig(kl_coef=0.1, entropy_coef=0.01)
    ent = torch.tensor([[2.0]])
    loss, stats = policy_loss(logp, logp.clone(), torch.tensor([1.0]), torch.ones(1, 1), cfg,
                              ref_logprobs=ref, entropy=ent)
    d = math.log(0.25) - math.log(0.5)
    k3 = math.exp(d) - d - 1  # 0.5 + ln 2 - 1
    assert stats.kl == pytest.approx(k3, abs=1e-6)
    assert float(loss) == pytest.approx(-1.0 + 0.1 * k3 - 0.01 * 2.0, abs=1e-6)


def test_token_logprobs_convention():
    logits = torch.tensor([[[2.0, 0.0, -1.0]]])
    logp, ent = token_logprobs(logits, torch.tensor([[0]]), temperature=2.0)
    want = torch.log_softmax(torch.tensor([1.0, 0.0, -0.5]), -1)[0]
    assert float(logp) == pytest.approx(float(want))
    p = torch.softmax(torch.tensor([1.0, 0.0, -0.5]), -1)
    assert float(ent) == pytest.approx(float(-(p * p.log()).sum()), abs=1e-6)
