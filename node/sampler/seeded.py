"""Replayable sampling: seeded Gumbel-max with independent noise per (seed, position).

Each completion has its own 63-bit seed, derived from (task ref, peer ID, policy version,
completion index) by `completion_seed`. The token at completion position t is

    argmax_v( logits[v] / temperature + g[v] ),   g = gumbel_noise(seed, t, V)

over the tokens that survive top-k / top-p, or plain argmax when temperature == 0. The noise
for position t is drawn from a generator seeded with H(seed, t), so a verifier can replay the
choice of any single token from the logits of one prefill, without replaying the sequence.
The noise is always drawn on the CPU (torch's mt19937), so it is the same on every machine.

Logprob convention: log_softmax(logits / temperature)[token] (plain log_softmax(logits) when
temperature == 0), before any top-k / top-p truncation.
"""

from __future__ import annotations

import hashlib
import json
import struct

import torch

from ...protocol.messages import SamplingParams, TaskRef

_SEED_DOMAIN = b"swarm-node/completion-seed/v1"
_POS_DOMAIN = b"swarm-node/gumbel/v1"
_TINY = torch.finfo(torch.float32).tiny


def _h63(*parts: bytes) -> int:
    digest = hashlib.blake2b(b"\x00".join(parts), digest_size=8).digest()
    return struct.unpack("<Q", digest)[0] >> 1


def ref_bytes(ref: TaskRef) -> bytes:
    """Canonical bytes of a task reference (sorted-key JSON)."""
    return json.dumps(ref.model_dump(mode="json"), sort_keys=True,
                      separators=(",", ":")).encode()


def completion_seed(ref: TaskRef, peer_id: str, policy_version: int, j: int) -> int:
    """The seed of completion j of task `ref` sampled by `peer_id` with `policy_version`."""
    return _h63(_SEED_DOMAIN, ref_bytes(ref), peer_id.encode(), str(int(policy_version)).encode(),
                str(int(j)).encode())


def position_seed(seed: int, position: int) -> int:
    return _h63(_POS_DOMAIN, struct.pack("<QQ", seed & (2**64 - 1), position))


def gumbel_noise(seed: int, position: int, vocab_size: int) -> torch.Tensor:
    """Gumbel(0, 1) noise, float32 [vocab_size], on the CPU, for (seed, position)."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed(position_seed(seed, position))
    u = torch.rand(vocab_size, generator=gen, dtype=torch.float32)
    e = (-torch.log(u.clamp_min(_TINY))).clamp_min(_TINY)  # Exp(1), never 0
    return -torch.log(e)


def mask_logits(scaled: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Apply top-k then top-p to temperature-scaled logits [..., V] (removed -> -inf)."""
    out = scaled
    if params.top_k and params.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, params.top_k, dim=-1).values[..., -1:]
        out = out.masked_fill(out < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(out, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # keep the smallest prefix whose mass reaches top_p (always at least the top token)
        before = torch.cumsum(probs, dim=-1) - probs
        drop_sorted = before >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        out = out.masked_fill(drop, float("-inf"))
    return out


def choose_token(logits: torch.Tensor, seed: int, position: int,
                 params: SamplingParams) -> tuple[int, float]:
    """(token, logprob) for one row of logits [V] at completion position `position`."""
    tokens, logprobs = choose_tokens(logits.unsqueeze(0), [seed], [position], params)
    return int(tokens[0]), float(logprobs[0])


def choose_tokens(logits: torch.Tensor, seeds: list[int], positions: list[int],
                  params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """Batched `choose_token`: logits [B, V] -> (tokens int64 [B], logprobs float32 [B])."""
    logits = logits.float()
    if params.temperature == 0.0:
        tokens = torch.argmax(logits, dim=-1)
        logp = torch.log_softmax(logits, dim=-1)
    else:
        scaled = logits / params.temperature
        logp = torch.log_softmax(scaled, dim=-1)
        masked = mask_logits(scaled, params)
        noise = torch.stack([gumbel_noise(s, p, logits.shape[-1])
                             for s, p in zip(seeds, positions)]).to(logits.device)
        tokens = torch.argmax(masked + noise, dim=-1)
    chosen = logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return tokens, chosen
