"""Sampling noise: a counter-based hash of (seed, position, token), part of the wire protocol.

A sampler picks the token at completion position t as argmax_v(s[v] + g(seed, t, v)), where
s are the temperature-scaled, truncated logits; a verifier recomputes g for any (t, v) it
needs. g is a pure function of three integers, computed with 64-bit integer tensor ops on the
device that holds the logits (no generator state, no host work per token), so it is
bit-identical on CPU and CUDA, for any thread count and batch layout, and any subset of
tokens can be evaluated alone. NODE_SPEC.md section 4 specifies it; tests/vectors/noise.json
holds known-answer vectors. All arithmetic is modulo 2^64:

    mix64(z)        = SplitMix64's finalizer:
                      z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
                      z = (z ^ (z >> 27)) * 0x94D049BB133111EB
                      z ^ (z >> 31)                              (>> logical)
    row_key(s, t)   = mix64(mix64(s ^ DOMAIN) + GOLDEN * (t + 1))
    bits(s, t, v)   = mix64(row_key(s, t) + GOLDEN * (v + 1))    (SplitMix64's v-th output)
    m               = bits >> 41                                 (top 23 bits)
    u               = (2m + 1) / 2^24                            (exact in float32, 0 < u < 1)
    g               = -log(-log(u))                              (float32, Gumbel(0, 1))

Only the float32 logarithms may differ between platforms (by an ulp or so); m is exact.
In torch, int64 arithmetic wraps modulo 2^64 like the unsigned arithmetic above; `>>` on
int64 is arithmetic, so each logical shift is an arithmetic shift and a mask.
"""

from __future__ import annotations

import hashlib
import math

import torch

M64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
MIX1 = 0xBF58476D1CE4E5B9
MIX2 = 0x94D049BB133111EB
DOMAIN = int.from_bytes(hashlib.blake2b(b"swarm-node/noise/v2", digest_size=8).digest(),
                        "little")
MANTISSA_BITS = 23
# Bounds of g over every u the rule can produce: used to skip tokens that cannot win.
U_MIN = 2.0 ** -24
U_MAX = 1.0 - 2.0 ** -24


def _signed(x: int) -> int:
    """An unsigned 64-bit constant as the int64 with the same bits."""
    return x - (1 << 64) if x >= 1 << 63 else x


_GOLDEN_S, _MIX1_S, _MIX2_S, _DOMAIN_S = (_signed(c) for c in (GOLDEN, MIX1, MIX2, DOMAIN))


# Reference implementation (Python integers): the spec in code, and the vectors' source. ----


def mix64_py(z: int) -> int:
    z &= M64
    z = ((z ^ (z >> 30)) * MIX1) & M64
    z = ((z ^ (z >> 27)) * MIX2) & M64
    return z ^ (z >> 31)


def row_key_py(seed: int, position: int) -> int:
    return mix64_py(mix64_py(seed ^ DOMAIN) + GOLDEN * (position + 1))


def noise_bits_py(seed: int, position: int, token: int) -> int:
    """bits(seed, position, token): an unsigned 64-bit integer."""
    return mix64_py(row_key_py(seed, position) + GOLDEN * (token + 1))


def uniform_py(seed: int, position: int, token: int) -> float:
    m = noise_bits_py(seed, position, token) >> (64 - MANTISSA_BITS)
    return (2 * m + 1) / 2.0 ** 24


# Tensor implementation ---------------------------------------------------------------------


def _shr(z: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bits."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def _mix64_(z: torch.Tensor) -> torch.Tensor:
    """mix64 in place, except the last xor-shift (callers that need all 64 bits add it)."""
    z ^= _shr(z, 30)
    z *= _MIX1_S
    z ^= _shr(z, 27)
    z *= _MIX2_S
    return z


def _mix64(z: torch.Tensor) -> torch.Tensor:
    z = _mix64_(z.clone())
    return z ^ _shr(z, 31)


def row_keys(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """row_key per row: seeds, positions int64 [B] (0 <= seed < 2^63) -> int64 [B]."""
    seeds = seeds.to(torch.int64)
    positions = positions.to(device=seeds.device, dtype=torch.int64)
    return _mix64(_mix64(seeds ^ _DOMAIN_S) + (positions + 1) * _GOLDEN_S)


_TOKEN_STEPS: dict[tuple[int, str], torch.Tensor] = {}


def _token_steps(vocab_size: int, device: torch.device) -> torch.Tensor:
    """GOLDEN * (v + 1) for v < vocab_size, cached per (size, device)."""
    key = (vocab_size, str(device))
    steps = _TOKEN_STEPS.get(key)
    if steps is None:
        steps = (torch.arange(1, vocab_size + 1, dtype=torch.int64, device=device)
                 * _GOLDEN_S)
        if len(_TOKEN_STEPS) > 16:
            _TOKEN_STEPS.clear()
        _TOKEN_STEPS[key] = steps
    return steps


def mantissas(keys: torch.Tensor, tokens: torch.Tensor | None = None,
              vocab_size: int = 0) -> torch.Tensor:
    """m = bits >> 41 (int64): for every token of each row ([B, V] from keys [B] and
    vocab_size) or for given tokens (keys and tokens of one shape)."""
    if tokens is None:
        z = keys.to(torch.int64)[:, None] + _token_steps(vocab_size, keys.device)
    else:
        z = keys + (tokens.to(torch.int64) + 1) * _GOLDEN_S
    # the final xor-shift of mix64 leaves bits 33..63 unchanged, so it is skipped
    z = _mix64_(z)
    return _shr(z, 64 - MANTISSA_BITS)


def gumbel_from_mantissas(m: torch.Tensor) -> torch.Tensor:
    """g = -log(-log((2m + 1) / 2^24)) in float32."""
    u = m.to(torch.float32).mul_(2.0 ** -23).add_(2.0 ** -24)  # exact: 2m+1 < 2^24
    return u.log_().neg_().log_().neg_()


def gumbel(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Gumbel noise float32 [B, V] on the seeds' device for rows (seed, position)."""
    return gumbel_from_mantissas(mantissas(row_keys(seeds, positions), vocab_size=vocab_size))


def gumbel_at(seeds: torch.Tensor, positions: torch.Tensor,
              tokens: torch.Tensor) -> torch.Tensor:
    """Gumbel noise at given tokens: seeds, positions [B]; tokens [B, K] -> float32 [B, K]."""
    keys = row_keys(seeds, positions)[:, None].expand_as(tokens)
    return gumbel_from_mantissas(mantissas(keys, tokens))


# g lies in [G_MIN, G_MAX] (float32 logs differ from these by far less than NOISE_SPAN_MARGIN)
G_MIN = -math.log(-math.log(U_MIN))
G_MAX = -math.log(-math.log1p(-(2.0 ** -24)))
NOISE_SPAN_MARGIN = 1e-3


def noisy_argmax(scores: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
                 prune: bool | None = None) -> torch.Tensor:
    """argmax_v(scores[b, v] + g(seeds[b], positions[b], v)) per row: int64 [B].

    `scores` are the masked, temperature-scaled logits [B, V] (-inf where truncated; each row
    keeps at least one finite score). With `prune` (default: on a CPU when V >= 4096) the
    noise is computed only for tokens that can still win: any token with scores[v] + G_MAX <
    S*, where S* is the best noisy score among the row's 8 highest scores, loses to that
    token whatever its noise. The result is exactly the full argmax (ties included: tied
    tokens are candidates too, and candidates keep their vocabulary order)."""
    v = scores.shape[-1]
    if prune is None:
        prune = scores.device.type == "cpu" and v >= 4096
    if not prune:
        return torch.argmax(scores + gumbel(seeds, positions, v), dim=-1)
    keys = row_keys(seeds, positions)
    top = torch.topk(scores, min(8, v), dim=-1).indices
    g_top = gumbel_from_mantissas(mantissas(keys[:, None].expand_as(top), top))
    best = (scores.gather(1, top) + g_top).max(dim=-1).values
    rows, cols = torch.nonzero(scores >= (best - G_MAX - NOISE_SPAN_MARGIN)[:, None],
                               as_tuple=True)
    noisy = torch.full_like(scores, float("-inf"))
    noisy[rows, cols] = scores[rows, cols] + gumbel_from_mantissas(mantissas(keys[rows], cols))
    return torch.argmax(noisy, dim=-1)
