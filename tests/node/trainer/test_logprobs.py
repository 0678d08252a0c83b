"""Chunked completion logprobs equal the full-logits reference, values and gradients."""

from __future__ import annotations

import pytest
import torch
from swarm_node.node.models import load_model
from swarm_node.node.trainer.data import TrainRow
from swarm_node.node.trainer.logprobs import (
    completion_logprobs,
    fast_head_supported,
    pack,
    plain_logprobs,
)


def _rows(vocab: int, n: int = 5, seed: int = 0) -> list[TrainRow]:
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        p = torch.randint(0, vocab, (3 + 2 * i,), generator=g).tolist()
        c = torch.randint(0, vocab, (1 + (7 * i) % 6,), generator=g).tolist()
        rows.append(TrainRow(p, c, None, 0.0, [1.0, 0.7, 0.0, 1.3, 2.0][i % 5], 0.0))
    return rows


def _grads(model, fn) -> tuple[torch.Tensor, torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    logp, ent = fn()
    (logp * torch.linspace(-1, 1, logp.shape[0])).sum().backward()
    return logp.detach(), ent.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                                         if p.grad is not None}


def _grouped(rows: list[TrainRow]) -> list[TrainRow]:
    """Rows 0, 2, 4 share row 0's prompt and rows 1, 3 row 1's (two GRPO groups)."""
    return [TrainRow(rows[i % 2].prompt_ids, r.completion_ids, None, 0.0, r.temperature, 0.0)
            for i, r in enumerate(rows)]


@pytest.mark.parametrize(("chunk", "shared"), [(1, False), (4, False), (1024, False),
                                               (3, True)])
def test_chunked_equals_full_logits_tiny(tiny_model_dir, chunk, shared):
    model, tok = load_model(tiny_model_dir)
    model.train()
    assert fast_head_supported(model)
    rows = _rows(model.config.vocab_size)
    if shared:
        rows = _grouped(rows)
        assert pack(rows, tok.pad_token_id, "cpu", share_prompts=True).ids.shape[0] == 2
    batch = pack(rows, tok.pad_token_id, "cpu", share_prompts=shared)
    assert batch.positions.shape[0] == sum(batch.lengths)
    reference = pack(rows, tok.pad_token_id, "cpu")  # separate rows, full logits
    ref_lp, ref_ent, ref_g = _grads(model, lambda: plain_logprobs(model, reference))
    lp, ent, g = _grads(model, lambda: completion_logprobs(model, batch, chunk=chunk))
    torch.testing.assert_close(lp, ref_lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, ref_ent, rtol=1e-5, atol=1e-5)
    assert set(g) == set(ref_g)
    for name in g:
        torch.testing.assert_close(g[name], ref_g[name], rtol=1e-4, atol=1e-6, msg=name)
    # the entropy-gradient path agrees too
    lp2, _, g2 = _grads(model, lambda: completion_logprobs(model, batch, chunk=chunk,
                                                           entropy_grad=True))
    torch.testing.assert_close(lp2, ref_lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(g2["lm_head.weight"], ref_g["lm_head.weight"], rtol=1e-4,
                               atol=1e-6)
    bf16, _ = completion_logprobs(model, batch, chunk=chunk, bf16_autocast=True)
    assert 0 < (bf16.detach() - ref_lp).abs().max() < 0.5  # bf16 decoder: close, not equal


@pytest.mark.slow
@pytest.mark.timeout(900)  # ~30 s on 2 free cores; much longer on a shared machine
def test_chunked_equals_full_logits_smollm2_tied_head(smollm2_dir):
    """The real model: tied input/output embeddings get both gradient contributions."""
    model, tok = load_model(smollm2_dir)
    model.train()
    assert model.config.tie_word_embeddings and fast_head_supported(model)
    batch = pack(_rows(model.config.vocab_size, n=2), tok.pad_token_id, "cpu")
    ref_lp, _, ref_g = _grads(model, lambda: plain_logprobs(model, batch))
    lp, _, g = _grads(model, lambda: completion_logprobs(model, batch, chunk=3))
    torch.testing.assert_close(lp, ref_lp, rtol=1e-4, atol=1e-4)
    for name in ("model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight"):
        # fp32 through 30 layers: summation order differs, so compare the whole tensor
        err = (g[name] - ref_g[name]).norm() / ref_g[name].norm()
        assert err < 1e-3, (name, float(err))
