"""Sampling noise (protocol/noise.py): the spec's integers, known-answer vectors, and the
properties the protocol needs (batch/thread independence, exact pruned argmax)."""

from __future__ import annotations

import hashlib
import json
import math
import random
from pathlib import Path

import pytest
import torch
from swarm_node.protocol import noise

VECTORS = Path(__file__).resolve().parents[1] / "vectors" / "noise.json"
M64 = (1 << 64) - 1


def spec_bits(seed: int, position: int, token: int) -> int:
    """NODE_SPEC.md section 4 written out again without torch or protocol/noise.py."""
    def mix(z):
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
        return z ^ (z >> 31)
    golden = 0x9E3779B97F4A7C15
    domain = int.from_bytes(hashlib.blake2b(b"swarm-node/noise/v2", digest_size=8).digest(),
                            "little")
    key = mix((mix(seed ^ domain)
               + golden * (position + 1)) & M64)
    return mix((key + golden * (token + 1)) & M64)


def test_known_answer_vectors():
    cases = json.loads(VECTORS.read_text())["cases"]
    assert len(cases) >= 4
    for case in cases:
        s, t, tokens = case["seed"], case["position"], case["tokens"]
        assert [f"{spec_bits(s, t, v):016x}" for v in tokens] == case["bits"]
        assert [int(b, 16) >> 41 for b in case["bits"]] == case["mantissa"]
        m = noise.mantissas(noise.row_keys(torch.tensor([s] * len(tokens)),
                                           torch.tensor([t] * len(tokens))),
                            torch.tensor(tokens))
        assert m.tolist() == case["mantissa"]
        g = noise.gumbel_at(torch.tensor([s]), torch.tensor([t]), torch.tensor([tokens]))[0]
        for u, m_i, got in zip(case["u"], case["mantissa"], g.tolist()):
            assert u == (2 * m_i + 1) / 2 ** 24
            assert got == pytest.approx(-math.log(-math.log(u)), rel=1e-5, abs=1e-6)


def test_tensor_rule_equals_reference_on_random_inputs():
    rng = random.Random(7)
    seeds = [rng.randrange(1 << 63) for _ in range(40)] + [0, (1 << 63) - 1]
    positions = [rng.randrange(1 << 31) for _ in seeds]
    m = noise.mantissas(noise.row_keys(torch.tensor(seeds), torch.tensor(positions)),
                        vocab_size=600)
    for i, (s, t) in enumerate(zip(seeds, positions)):
        for v in (0, 1, rng.randrange(600), 599):
            assert int(m[i, v]) == noise.noise_bits_py(s, t, v) >> 41 == spec_bits(s, t, v) >> 41


def test_noise_does_not_depend_on_batch_layout_or_threads():
    seeds = torch.tensor([3, 1 << 62, 99, 12345678901])
    positions = torch.tensor([0, 7, 7, 1000])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)  # whatever the session's default (1 in an xdist worker)
        together = noise.gumbel(seeds, positions, 5000)
        torch.set_num_threads(1)
        alone = torch.cat([noise.gumbel(seeds[i:i + 1], positions[i:i + 1], 5000)
                           for i in range(4)])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(together, alone)
    assert torch.equal(noise.gumbel(seeds, positions, 300), together[:, :300])  # prefix
    assert not torch.equal(together[1], together[2])  # other seed, same position


def test_noise_is_gumbel_distributed():
    g = noise.gumbel(torch.arange(64), torch.zeros(64, dtype=torch.long), 4096).double()
    assert g.mean().item() == pytest.approx(0.5772, abs=0.01)  # Euler-Mascheroni
    assert g.var().item() == pytest.approx(math.pi ** 2 / 6, rel=0.02)
    m = noise.mantissas(noise.row_keys(torch.arange(64), torch.zeros(64, dtype=torch.long)),
                        vocab_size=4096)
    counts = torch.bincount((m >> 19).flatten(), minlength=16).double()  # 16 equal buckets
    expected = m.numel() / 16
    assert float(((counts - expected) ** 2 / expected).sum()) < 45  # chi2(15): p < 1e-4
    assert noise.G_MIN <= float(g.min()) and float(g.max()) <= noise.G_MAX


@pytest.mark.parametrize("shape", ["flat", "peaked", "masked", "ties"])
def test_pruned_argmax_is_exactly_the_full_argmax(shape):
    torch.manual_seed(0)
    b, v = 64, 8192
    scores = torch.randn(b, v) * (0.5 if shape == "flat" else 6.0)
    if shape == "masked":
        scores[:, 20:] = float("-inf")
    if shape == "ties":
        scores = torch.round(scores)
    seeds = torch.randint(0, 1 << 62, (b,))
    positions = torch.randint(0, 500, (b,))
    full = noise.noisy_argmax(scores, seeds, positions, prune=False)
    assert torch.equal(noise.noisy_argmax(scores, seeds, positions, prune=True), full)
