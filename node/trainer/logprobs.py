"""Log-probabilities of the completion tokens, without full-vocabulary logits everywhere.

A plain `model(ids).logits` computes the LM head at every position of every row (prompt
included) and keeps [B, L, V] float logits plus a log_softmax of the same size for the
backward pass; with SmolLM2's 49,152-token vocabulary that is most of a training step's
memory traffic. Here the decoder runs once, the final-norm hidden states of the positions
that predict completion tokens are gathered ([N, H], N = completion tokens), and the LM head
is applied to them in chunks of `chunk` positions. `ChosenLogprob` keeps only the chunk's
hidden states and log-sum-exp for the backward pass and recomputes the chunk's logits there,
so at most one [chunk, V] block is alive at a time. The rows of one prompt (a GRPO group)
can share one pass over the prompt (`pack(..., share_prompts=True)`).

Convention (same as the sampler): logprob = log_softmax(logits / T)[token]; entropy is that
of softmax(logits / T), reported without a gradient unless an entropy bonus needs one.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from .grpo import token_logprobs


@dataclass
class PackedBatch:
    """Rows (prompt + completion) laid out as decoder input, and where the completion tokens
    are: flat indices into [S * L] of the positions whose outputs predict them."""

    ids: torch.Tensor          # int64 [S, L]
    attention: torch.Tensor    # int64 [S, L] (one row per sequence) or bool [S, 1, L, L]
    position_ids: torch.Tensor | None  # int64 [S, L] with the 4-D mask
    positions: torch.Tensor    # int64 [N]: s * L + t; the output at t predicts a token
    targets: torch.Tensor      # int64 [N]
    inv_temp: torch.Tensor     # float32 [N]
    lengths: list[int]         # completion tokens per row (sums to N), in row order

    def decoder_inputs(self) -> dict:
        out = {"input_ids": self.ids, "attention_mask": self.attention, "use_cache": False}
        if self.position_ids is not None:
            out["position_ids"] = self.position_ids
        return out


def pack(rows, pad_id: int, device, share_prompts: bool = False) -> PackedBatch:
    """`rows`: objects with prompt_ids, completion_ids and temperature (TrainRow); outputs
    (logprobs) come back in row order.

    share_prompts: the rows of one prompt (a GRPO group) become ONE sequence, prompt then
    every completion, with a 4-D mask that lets each completion see the prompt and its own
    earlier tokens only and position ids that restart after the prompt: the same values as
    separate rows, but the prompt goes through the decoder (and its backward) once."""
    if share_prompts:
        return _pack_shared(rows, pad_id, device)
    width = max(len(r.prompt_ids) + len(r.completion_ids) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    positions = []
    for i, r in enumerate(rows):
        p, c = len(r.prompt_ids), len(r.completion_ids)
        ids[i, :p + c] = torch.tensor(list(r.prompt_ids) + list(r.completion_ids))
        attention[i, :p + c] = 1
        positions.append(torch.arange(p - 1, p + c - 1) + i * width)
    positions_t = torch.cat(positions)
    targets = torch.cat([torch.tensor(list(r.completion_ids), dtype=torch.long) for r in rows])
    return PackedBatch(ids.to(device), attention.to(device), None, positions_t.to(device),
                       targets.to(device), _inv_temp(rows).to(device),
                       [len(r.completion_ids) for r in rows])


def _pack_shared(rows, pad_id: int, device) -> PackedBatch:
    groups: dict[tuple, list[int]] = {}
    for i, r in enumerate(rows):
        groups.setdefault(tuple(r.prompt_ids), []).append(i)
    width = max(len(p) + sum(len(rows[i].completion_ids) for i in members)
                for p, members in groups.items())
    n = len(groups)
    ids = torch.full((n, width), pad_id, dtype=torch.long)
    pos_ids = torch.zeros((n, width), dtype=torch.long)
    mask = torch.eye(width, dtype=torch.bool).repeat(n, 1, 1, 1)  # padding sees itself
    where: list[torch.Tensor] = [torch.empty(0, dtype=torch.long)] * len(rows)
    for s, (prompt, members) in enumerate(groups.items()):
        p = len(prompt)
        ids[s, :p] = torch.tensor(prompt)
        pos_ids[s, :p] = torch.arange(p)
        mask[s, 0, :p, :p] = torch.ones(p, p, dtype=torch.bool).tril()
        start = p
        for i in members:
            comp = list(rows[i].completion_ids)
            c = len(comp)
            ids[s, start:start + c] = torch.tensor(comp)
            pos_ids[s, start:start + c] = torch.arange(p, p + c)
            mask[s, 0, start:start + c, :p] = True
            mask[s, 0, start:start + c, start:start + c] = torch.ones(c, c,
                                                                      dtype=torch.bool).tril()
            # token 0 is predicted by the prompt's last position, token j by completion j-1
            where[i] = torch.cat([torch.tensor([p - 1]), torch.arange(start, start + c - 1)]) \
                + s * width
            start += c
    positions = torch.cat(where)
    targets = torch.cat([torch.tensor(list(r.completion_ids), dtype=torch.long) for r in rows])
    return PackedBatch(ids.to(device), mask.to(device), pos_ids.to(device),
                       positions.to(device), targets.to(device), _inv_temp(rows).to(device),
                       [len(r.completion_ids) for r in rows])


def _inv_temp(rows) -> torch.Tensor:
    return torch.cat([torch.full((len(r.completion_ids),),
                                 1.0 / (r.temperature if r.temperature and r.temperature > 0
                                        else 1.0)) for r in rows])


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
        out = model.get_decoder()(**batch.decoder_inputs())
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
    logits = model(**batch.decoder_inputs()).logits
    flat = logits.reshape(-1, logits.shape[-1]).index_select(0, batch.positions)
    logp, ent = token_logprobs((flat * batch.inv_temp[:, None])[None], batch.targets[None])
    return logp[0], ent[0]


def _autocast(device: torch.device, enabled: bool):
    if not enabled:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
