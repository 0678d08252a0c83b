"""Log-probabilities of the completion tokens, without full-vocabulary logits everywhere.

A plain `model(ids).logits` computes the LM head at every position of every row (prompt
included) and keeps [B, L, V] float logits plus a log_softmax of the same size for the
backward pass; with SmolLM2's 49,152-token vocabulary that is most of a training step's
memory traffic. Here the decoder runs once, the final-norm hidden states of the positions
that predict completion tokens are gathered ([N, H], N = completion tokens), and the LM head
is applied to them in chunks of `chunk` positions. `ChosenLogprob` keeps only the chunk's
hidden states and log-sum-exp for the backward pass and recomputes the chunk's logits there,
so at most one [chunk, V] block is alive at a time.

Convention (same as the sampler): logprob = log_softmax(logits / T)[token]; entropy is that
of softmax(logits / T), reported without a gradient unless an entropy bonus needs one.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch


@dataclass
class PackedBatch:
    """Rows (prompt + completion) right-padded into one batch, and where the completion
    tokens are: flat indices into [B * L] of the positions whose logits predict them."""

    ids: torch.Tensor          # int64 [B, L]
    attention: torch.Tensor    # int64 [B, L]
    positions: torch.Tensor    # int64 [N]: b * L + t, logits at t predict token t + 1
    targets: torch.Tensor      # int64 [N]
    inv_temp: torch.Tensor     # float32 [N]
    lengths: list[int]         # completion tokens per row (sums to N)


def pack(rows, pad_id: int, device) -> PackedBatch:
    """`rows`: objects with prompt_ids, completion_ids and temperature (TrainRow)."""
    width = max(len(r.prompt_ids) + len(r.completion_ids) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    positions, inv_temp, lengths = [], [], []
    for i, r in enumerate(rows):
        p, c = len(r.prompt_ids), len(r.completion_ids)
        ids[i, :p + c] = torch.tensor(list(r.prompt_ids) + list(r.completion_ids))
        attention[i, :p + c] = 1
        positions.append(torch.arange(p - 1, p + c - 1) + i * width)
        temp = r.temperature if r.temperature and r.temperature > 0 else 1.0
        inv_temp.append(torch.full((c,), 1.0 / temp))
        lengths.append(c)
    positions_t = torch.cat(positions)
    targets = ids.view(-1)[positions_t + 1]
    return PackedBatch(ids.to(device), attention.to(device), positions_t.to(device),
                       targets.to(device), torch.cat(inv_temp).to(device), lengths)


class ChosenLogprob(torch.autograd.Function):
    """log_softmax(hidden @ W.T * inv_temp)[target] per row, and the (detached) entropy."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, inv_temp):
        logits = (hidden.float() @ weight.float().T) * inv_temp[:, None]
        lse = torch.logsumexp(logits, dim=-1)
        logp = logits.gather(1, targets[:, None])[:, 0] - lse
        probs = torch.exp(logits - lse[:, None])
        entropy = lse - (probs * logits).sum(-1)
        ctx.save_for_backward(hidden, weight, targets, inv_temp, lse)
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, _grad_entropy):
        hidden, weight, targets, inv_temp, lse = ctx.saved_tensors
        w = weight.float()
        logits = (hidden.float() @ w.T) * inv_temp[:, None]
        # d logp / d logits = (onehot(target) - softmax) * inv_temp
        grad = torch.exp(logits - lse[:, None]).mul_(-grad_logp[:, None])
        grad[torch.arange(grad.shape[0], device=grad.device), targets] += grad_logp
        grad.mul_(inv_temp[:, None])
        grad_hidden = (grad @ w).to(hidden.dtype) if ctx.needs_input_grad[0] else None
        grad_weight = (grad.T @ hidden.float()).to(weight.dtype) \
            if ctx.needs_input_grad[1] else None
        return grad_hidden, grad_weight, None, None


def fast_head_supported(model) -> bool:
    """A plain linear LM head (no bias, no logit scaling or soft-capping) on a decoder."""
    head = model.get_output_embeddings()
    cfg = model.config
    return (hasattr(model, "get_decoder") and isinstance(head, torch.nn.Linear)
            and head.bias is None and not getattr(cfg, "final_logit_softcapping", None)
            and getattr(cfg, "logit_scale", None) in (None, 1.0))


def completion_logprobs(model, batch: PackedBatch, *, chunk: int = 1024,
                        bf16_autocast: bool = False, entropy_grad: bool = False
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprobs [N], entropy [N]) of the completion tokens under `model`."""
    with _autocast(batch.ids.device, bf16_autocast):
        out = model.get_decoder()(input_ids=batch.ids, attention_mask=batch.attention,
                                  use_cache=False)
    hidden = out.last_hidden_state
    hidden = hidden.reshape(-1, hidden.shape[-1]).index_select(0, batch.positions)
    weight = model.get_output_embeddings().weight
    parts_lp, parts_ent = [], []
    for start in range(0, hidden.shape[0], chunk):
        sl = slice(start, start + chunk)
        if entropy_grad:  # the entropy bonus needs its gradient: plain autograd per chunk
            logits = (hidden[sl].float() @ weight.float().T) * batch.inv_temp[sl, None]
            logp_all = torch.log_softmax(logits, dim=-1)
            parts_lp.append(logp_all.gather(1, batch.targets[sl, None])[:, 0])
            parts_ent.append(-(logp_all.exp() * logp_all).sum(-1))
        else:
            lp, ent = ChosenLogprob.apply(hidden[sl], weight, batch.targets[sl],
                                          batch.inv_temp[sl])
            parts_lp.append(lp)
            parts_ent.append(ent)
    return torch.cat(parts_lp), torch.cat(parts_ent)


def plain_logprobs(model, batch: PackedBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference path: full logits and log_softmax at every position (any model)."""
    from .grpo import token_logprobs

    logits = model(input_ids=batch.ids, attention_mask=batch.attention,
                   use_cache=False).logits
    flat = logits.reshape(-1, logits.shape[-1]).index_select(0, batch.positions)
    logp, ent = token_logprobs((flat * batch.inv_temp[:, None])[None], batch.targets[None])
    return logp[0], ent[0]


def _autocast(device: torch.device, enabled: bool):
    if not enabled:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
