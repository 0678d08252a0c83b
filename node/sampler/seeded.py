"""Replayable sampling: seeded Gumbel-max with counter-based noise per (seed, position, token).

Each completion has its own 63-bit seed, derived from (task ref, peer ID, policy version,
completion index) by `completion_seed`. The token at completion position t is

    argmax_v( logits[v] / temperature + g(seed, t, v) )

over the tokens that survive top-k / top-p, or plain argmax when temperature == 0. The noise
g is the protocol's counter-based hash (`protocol/noise.py`): computed with integer tensor
ops on the logits' device, bit-identical on every machine, so a verifier can replay the
choice of any single token from the logits of one prefill, without replaying the sequence.

Logprob convention: log_softmax(logits / temperature)[token] (plain log_softmax(logits) when
temperature == 0), before any top-k / top-p truncation.
"""

from __future__ import annotations

import hashlib
import json
import struct

import torch

from ...protocol import noise
from ...protocol.messages import SamplingParams, TaskRef

_SEED_DOMAIN = b"swarm-node/completion-seed/v1"


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


def gumbel_noise(seed: int, position: int, vocab_size: int,
                 device: str | torch.device = "cpu") -> torch.Tensor:
    """Gumbel(0, 1) noise, float32 [vocab_size], for (seed, position), on `device`."""
    return gumbel_rows([seed], [position], vocab_size, device)[0]


def gumbel_rows(seeds: list[int] | torch.Tensor, positions: list[int] | torch.Tensor,
                vocab_size: int, device: str | torch.device = "cpu") -> torch.Tensor:
    """Noise for many (seed, position) rows at once: float32 [len(seeds), vocab_size]. A
    verifier replaying T positions of one completion passes its seed T times and 0..T-1."""
    seeds_t = torch.as_tensor(seeds, dtype=torch.int64, device=device)
    positions_t = torch.as_tensor(positions, dtype=torch.int64, device=device)
    return noise.gumbel(seeds_t, positions_t, vocab_size)


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


def choose_tokens(logits: torch.Tensor, seeds: list[int] | torch.Tensor,
                  positions: list[int] | torch.Tensor, params: SamplingParams,
                  noise_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The seeded token choice of each row: logits [B, V] -> (tokens int64 [B], logprobs
    float32 [B]); row i uses `seeds[i]` at completion position `positions[i]`.

    `noise_rows` [B, V]: the rows' noise, already computed (e.g. for many steps at once);
    otherwise it is computed here, on the logits' device."""
    logits = logits.float()
    if params.temperature == 0.0:
        tokens = torch.argmax(logits, dim=-1)
        logp = torch.log_softmax(logits, dim=-1)
    else:
        scaled = logits / params.temperature
        logp = torch.log_softmax(scaled, dim=-1)
        masked = mask_logits(scaled, params)
        if noise_rows is not None:
            tokens = torch.argmax(masked + noise_rows, dim=-1)
        else:
            device = logits.device
            tokens = noise.noisy_argmax(
                masked, torch.as_tensor(seeds, dtype=torch.int64, device=device),
                torch.as_tensor(positions, dtype=torch.int64, device=device))
    chosen = logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return tokens, chosen
