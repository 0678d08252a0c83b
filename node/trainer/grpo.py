"""GRPO advantages and the two-sided-clipped policy loss.

Advantages are normalised per group (all completions of one task):
    A_i = (r_i - mean(r)) / (std(r) + eps)      std: population std (divide by G)
A group whose rewards are all equal has A = 0 for every member and carries no signal; such
groups are filtered out before batching (`has_signal`).

Loss per completion token t of completion i (ratio rho = exp(logp - logp_behaviour)):
    l_t = -min( min(rho, delta) * A_i,  clip(rho, 1 - eps_low, 1 + eps_high) * A_i )
The delta cap bounds the unclipped term, which PPO leaves unbounded when A < 0 and the
ratio is large (INTELLECT-2's two-sided clipping). Aggregation is token-level: the sum of
l_t over every completion token of the batch divided by the number of those tokens, so a
long completion weighs in proportion to its length (DAPO style), not 1/len per sequence.
Optional terms: + kl_coef * k3(logp, logp_ref) (token-level, same aggregation) and
- entropy_coef * entropy (token-level, same aggregation).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ADV_EPS = 1e-6


def group_advantages(rewards: torch.Tensor, eps: float = ADV_EPS) -> torch.Tensor:
    """(r - mean) / (std + eps) over the last dimension (population std)."""
    rewards = rewards.to(torch.float32)
    mean = rewards.mean(dim=-1, keepdim=True)
    std = rewards.std(dim=-1, keepdim=True, unbiased=False)
    return (rewards - mean) / (std + eps)


def has_signal(rewards, tol: float = 1e-9) -> bool:
    """False for a zero-advantage group (all rewards equal, or fewer than two)."""
    values = [float(r) for r in rewards]
    return len(values) > 1 and max(values) - min(values) > tol


@dataclass
class LossConfig:
    eps_low: float = 0.2
    eps_high: float = 0.28
    delta: float = 4.0
    kl_coef: float = 0.0
    entropy_coef: float = 0.0


@dataclass
class LossStats:
    loss: float
    policy_loss: float
    clip_low_frac: float   # tokens with A < 0 whose ratio fell below 1 - eps_low
    clip_high_frac: float  # tokens with A > 0 whose ratio rose above 1 + eps_high
    delta_frac: float      # tokens whose ratio exceeded delta
    mean_ratio: float
    kl: float
    entropy: float
    tokens: int


def policy_loss(
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: LossConfig | None = None,
    ref_logprobs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, LossStats]:
    """Token-level two-sided-clipped GRPO loss.

    logprobs, behaviour_logprobs, mask (and ref_logprobs, entropy if given): [B, T];
    advantages: [B] (one per completion) or [B, T]. Returns (scalar loss, stats).
    """
    cfg = cfg or LossConfig()
    mask = mask.to(logprobs.dtype)
    if advantages.dim() == 1:
        advantages = advantages[:, None].expand_as(logprobs)
    advantages = advantages.to(logprobs.dtype)
    ntok = mask.sum().clamp_min(1.0)

    log_ratio = (logprobs - behaviour_logprobs.to(logprobs.dtype)) * mask
    ratio = torch.exp(log_ratio)
    unclipped = torch.clamp(ratio, max=cfg.delta) * advantages
    clipped = torch.clamp(ratio, 1.0 - cfg.eps_low, 1.0 + cfg.eps_high) * advantages
    per_token = -torch.minimum(unclipped, clipped)
    pg = (per_token * mask).sum() / ntok
    loss = pg

    kl_value = torch.zeros(())
    if cfg.kl_coef > 0 and ref_logprobs is not None:
        d = (ref_logprobs.to(logprobs.dtype) - logprobs) * mask
        kl_tok = torch.exp(d) - d - 1.0  # k3 estimator, >= 0
        kl_value = (kl_tok * mask).sum() / ntok
        loss = loss + cfg.kl_coef * kl_value
    ent_value = torch.zeros(())
    if entropy is not None:
        ent_value = (entropy * mask).sum() / ntok
        if cfg.entropy_coef > 0:
            loss = loss - cfg.entropy_coef * ent_value

    with torch.no_grad():
        m = mask.bool()
        n = max(int(m.sum()), 1)
        stats = LossStats(
            loss=float(loss.detach()),
            policy_loss=float(pg.detach()),
            clip_low_frac=float(((ratio < 1 - cfg.eps_low) & (advantages < 0) & m).sum()) / n,
            clip_high_frac=float(((ratio > 1 + cfg.eps_high) & (advantages > 0) & m).sum()) / n,
            delta_frac=float(((ratio > cfg.delta) & m).sum()) / n,
            mean_ratio=float((ratio * mask).sum() / ntok),
            kl=float(kl_value),
            entropy=float(ent_value),
            tokens=int(m.sum()),
        )
    return loss, stats


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0):
    """log_softmax(logits / temperature)[target] per position, and the entropy there.

    logits: [B, T, V] predicting targets [B, T]. Same convention as the sampler's logprobs.
    """
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    logp_all = torch.log_softmax(logits.float(), dim=-1)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy
