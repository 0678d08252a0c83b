"""Activation proofs: a compact, locality-sensitive commitment to final-norm hidden states.

The construction follows TOPLOC (arXiv 2501.16007): the completion's hidden states are cut
into chunks of `CHUNK_TOKENS` decoded tokens; in each chunk the `TOP_K` values of largest
magnitude (flattened index = token * hidden + channel) are interpolated by a polynomial over
the prime field `PRIME`, P(index mod m) = 16-bit pattern of the value. The proof stores m and
the polynomial's coefficients, so the verifier, who recomputes the hidden states with one
prefill, evaluates P at *its own* top-k indices: a wrong index yields a random pattern.

It is stricter than TOPLOC:
- values are committed as IEEE fp16 (11-bit significand) instead of bf16 (8 bits), so a
  value is pinned to 2^-11 relative instead of 2^-8;
- the sign counts (TOPLOC compares exponent and mantissa only);
- the comparison works on relative errors with tight, calibrated thresholds on index
  mismatches, mean absolute deviation and signed bias (a systematic scaling is caught by
  the bias even when each value is within a few ulps);
- the proof has a version byte and an exact length derived from the verifier's own token
  count and hidden size: missing, truncated, extra or padded proofs are rejected;
- parsing and checking are total: any bytes give a `ProofResult`, never an exception, and
  nothing is allocated from sizes written in the proof.

Format (version 1), for T completion tokens and hidden size H:
    byte 0            : 0x01 (format version)
    per chunk i       : uint16 LE modulus m_i, then k_i uint16 LE coefficients c_0..c_{k-1}
where chunk i covers tokens [32 i, min(32 (i + 1), T)), c_i tokens, k_i = min(128, c_i H),
every coefficient < PRIME, and m_i is canonical: the largest m <= PRIME for which the
chunk's top-k indices are distinct mod m (PRIME whenever c_i H <= PRIME). A full chunk is 258 bytes
(8.06 bytes per token); the length is exactly 1 + sum_i (2 + 2 k_i).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from .reasons import PROOF_REASONS as REASONS  # noqa: F401 - re-exported

FORMAT_VERSION = 1
PRIME = 65497
MIN_MODULUS = 32768
CHUNK_TOKENS = 32
TOP_K = 128
FP16_MAX = 65504.0
_NAN16 = 0x7E00
_GROUP = 64  # chunks interpolated together (bounds the [n, k, k] work tensor)


@dataclass(frozen=True)
class ProofThresholds:
    """Acceptance thresholds, per chunk. Relative error e = (claimed - recomputed) / |recomputed|.

    A top-k entry *matches* when the claimed value is finite, has the recomputed sign and
    |e| <= match_rel. A chunk passes when at most `max_mismatches` entries do not match and,
    over the matched entries, mean |e| <= max_mean_abs and |mean e| <= max_bias.
    """

    match_rel: float = 2.0**-6
    max_mismatches: int = 8
    max_mean_abs: float = 3.5e-4
    max_bias: float = 1.2e-4
    # 16-bit inference: a chunk of c < 32 tokens gets max_mean_abs and max_bias times
    # sqrt(32 / c). Its top-k values come from c rows, and a row's error is shared by its
    # values (one decode step vs the verifier's prefill), so the chunk mean averages c
    # row errors: measured on SmolLM2 bf16, 8-token chunks reach bias 2.2e-2 where 32-token
    # chunks stay below 9.1e-3 (RESULTS.md "verifier-real"). Full chunks keep the limits.
    widen_short_chunks: bool = False

    def limits(self, tokens: int) -> tuple[float, float]:
        """(max_mean_abs, max_bias) for a chunk of `tokens` tokens."""
        if not self.widen_short_chunks or tokens >= CHUNK_TOKENS:
            return self.max_mean_abs, self.max_bias
        scale = (CHUNK_TOKENS / max(tokens, 1)) ** 0.5
        return self.max_mean_abs * scale, self.max_bias * scale

    @classmethod
    def for_dtype(cls, dtype: str) -> ProofThresholds:
        """Defaults for float32 inference; looser ones for 16-bit inference: the worst honest
        bf16 values measured on SmolLM2-135M (KV-cache decode vs the verifier's prefill,
        CPU) with a margin (RESULTS.md "verifier-real"; short chunks of few tokens are the
        noisiest). The price: a model scaled by 1.01 is no longer caught by the proof
        alone in bf16."""
        if dtype in ("bfloat16", "float16"):
            return cls(match_rel=2.0**-3, max_mismatches=24, max_mean_abs=4.5e-2, max_bias=2e-2,
                       widen_short_chunks=True)
        return cls()


@dataclass
class ProofResult:
    """The verdict on one proof. `reason` is "ok" or a stable reject code."""

    ok: bool
    reason: str
    detail: str = ""
    chunks: int = 0
    worst_mismatches: int = 0
    worst_mean_abs: float = 0.0
    worst_bias: float = 0.0
    worst_mean_abs_ratio: float = 0.0  # max over chunks of mean_abs / the chunk's limit
    worst_bias_ratio: float = 0.0
    stats: list[dict] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)


# Chunk layout ----------------------------------------------------------------------------


def chunk_layout(num_tokens: int, hidden_size: int) -> list[tuple[int, int]]:
    """(tokens, k) of each chunk."""
    out = []
    for start in range(0, num_tokens, CHUNK_TOKENS):
        c = min(CHUNK_TOKENS, num_tokens - start)
        out.append((c, min(TOP_K, c * hidden_size)))
    return out


def proof_size(num_tokens: int, hidden_size: int) -> int:
    return 1 + sum(2 + 2 * k for _, k in chunk_layout(num_tokens, hidden_size))


def _chunk_topk(hidden: torch.Tensor) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per chunk: (flat indices [k] int64, values [k] float32) of the top-k by magnitude."""
    t, h = hidden.shape
    out = []
    full = t // CHUNK_TOKENS
    with torch.no_grad():
        if full:
            flat = hidden[: full * CHUNK_TOKENS].reshape(full, CHUNK_TOKENS * h)
            k = min(TOP_K, CHUNK_TOKENS * h)
            idx = flat.abs().topk(k, dim=1, sorted=False).indices
            vals = flat.gather(1, idx)
            out += list(zip(idx.numpy(), vals.numpy()))
        if t % CHUNK_TOKENS:
            flat = hidden[full * CHUNK_TOKENS:].reshape(-1)
            k = min(TOP_K, flat.numel())
            idx = flat.abs().topk(k, sorted=False).indices
            out.append((idx.numpy(), flat[idx].numpy()))
    return out


# Field arithmetic (numpy int64) ----------------------------------------------------------


def _inv_mod(a: np.ndarray) -> np.ndarray:
    """a^(p-2) mod p, elementwise (Fermat)."""
    result = np.ones_like(a)
    base = a % PRIME
    e = PRIME - 2
    while e:
        if e & 1:
            result = result * base % PRIME
        base = base * base % PRIME
        e >>= 1
    return result


def _powers(xs: np.ndarray, k: int) -> np.ndarray:
    """[n, j, k]: xs^r mod p for r < k, by doubling."""
    n, j = xs.shape
    out = np.empty((n, j, k), dtype=np.int64)
    out[..., 0] = 1
    s = 1
    if k > 1:
        out[..., 1] = xs
        s = 2
    while s < k:
        x_s = out[..., s - 1] * xs % PRIME
        m = min(s, k - s)
        out[..., s:s + m] = out[..., :m] * x_s[..., None] % PRIME
        s += m
    return out


def _prod_mod(t: np.ndarray) -> np.ndarray:
    """Product mod p along the last axis, by pairwise halving."""
    while t.shape[-1] > 1:
        if t.shape[-1] % 2:
            t = np.concatenate([t, np.ones_like(t[..., :1])], axis=-1)
        half = t.shape[-1] // 2
        t = t[..., :half] * t[..., half:] % PRIME
    return t[..., 0]


def _master_by_steps(xs: np.ndarray) -> np.ndarray:
    """Coefficients (low to high, [n, k + 1]) of prod_j (x - xs_j), one factor at a time."""
    n, k = xs.shape
    master = np.zeros((n, k + 1), dtype=np.int64)
    master[:, 0] = 1
    for j in range(k):
        shifted = np.zeros_like(master)
        shifted[:, 1:] = master[:, :-1]
        master = (shifted - xs[:, j:j + 1] * master) % PRIME
    return master


_LAGRANGE: dict[int, np.ndarray] = {}


def _lagrange_basis(m: int) -> np.ndarray:
    """[m, m]: row s holds the coefficients of the Lagrange basis polynomial of point s on
    the points 0..m-1 (computed once per m)."""
    if m not in _LAGRANGE:
        points = np.tile(np.arange(m, dtype=np.int64), (m, 1))
        shared = _master_by_steps(points[:1])  # every row has the same points
        _LAGRANGE[m] = _interpolate(points, np.eye(m, dtype=np.int64),
                                    lambda xs: np.repeat(shared, m, axis=0))
    return _LAGRANGE[m]


def _master(xs: np.ndarray) -> np.ndarray:
    """prod_j (x - xs_j) as coefficients: evaluated at 0..k (vectorised), then interpolated
    with the fixed Lagrange basis."""
    _, k = xs.shape
    z = np.arange(k + 1, dtype=np.int64)
    values = _prod_mod((z[None, :, None] - xs[:, None, :]) % PRIME)  # [n, k + 1]
    exact = np.rint(values.astype(np.float64) @ _lagrange_basis(k + 1).astype(np.float64))
    return exact.astype(np.int64) % PRIME


def _interpolate(xs: np.ndarray, ys: np.ndarray, master_fn=None) -> np.ndarray:
    """Coefficients (low to high, [n, k]) of the polynomials with P(xs) = ys over F_p.

    xs: [n, k] int64, distinct within a row, in [0, p); ys: [n, k] int64 in [0, p).
    Lagrange: P = sum_i a_i M(x) / (x - x_i) with M = prod (x - x_i), a_i = y_i / M'(x_i);
    the coefficient of x^d is sum_{e > d} M_e S_{e-d-1} with power sums S_r = sum_i a_i x_i^r.
    Products of two residues are < 2^32 and k <= 2^20 of them sum below 2^63.
    """
    _, k = xs.shape
    master = (master_fn or _master)(xs)
    pw = _powers(xs, k)  # [n, i, r]
    deriv = master[:, 1:] * np.arange(1, k + 1) % PRIME  # M'(x) coefficients
    weights = (pw * deriv[:, None, :]).sum(-1) % PRIME  # M'(x_i)
    a = ys * _inv_mod(weights) % PRIME
    sums = (a[:, :, None] * pw).sum(1) % PRIME  # S_r
    r = np.arange(1, k + 1)[None, :] - np.arange(k)[:, None] - 1  # [d, e-1]
    hankel = sums[:, np.clip(r, 0, None)] * (r >= 0)
    return (hankel * master[:, None, 1:]).sum(-1) % PRIME


def _evaluate(coeffs: np.ndarray, xs: np.ndarray) -> np.ndarray:
    """P(xs) over F_p: coeffs [n, k] (low to high), xs [n, j] -> [n, j]."""
    return (_powers(xs, coeffs.shape[1]) * coeffs[:, None, :]).sum(-1) % PRIME


def _choose_moduli(idx: np.ndarray) -> np.ndarray:
    """Per row, the largest m <= PRIME for which idx mod m is distinct ([n] int64)."""
    n = idx.shape[0]
    chosen = np.full(n, -1, dtype=np.int64)
    chosen[idx.max(axis=1) < PRIME] = PRIME  # indices below p are already distinct
    pending = np.flatnonzero(chosen < 0)
    top = PRIME
    while pending.size and top >= MIN_MODULUS:
        ms = np.arange(top, max(top - 16, MIN_MODULUS - 1), -1, dtype=np.int64)
        r = np.sort(idx[pending][:, None, :] % ms[None, :, None], axis=-1)
        distinct = (r[..., 1:] != r[..., :-1]).all(axis=-1)  # [rows, candidates]
        found = distinct.any(axis=1)
        chosen[pending[found]] = ms[distinct[found].argmax(axis=1)]
        pending = pending[~found]
        top -= 16
    if pending.size:
        raise ValueError("no modulus separates the top-k indices (degenerate hidden states)")
    return chosen


def _to_fp16_bits(values: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore"):
        half = np.clip(values.astype(np.float32), -FP16_MAX, FP16_MAX).astype(np.float16)
    bits = half.view(np.uint16).astype(np.int64)
    return np.where(bits >= PRIME, _NAN16, bits)


def _from_fp16_bits(bits: np.ndarray) -> np.ndarray:
    return bits.astype(np.uint16).view(np.float16).astype(np.float32)


# Build -----------------------------------------------------------------------------------


def build_proofs(hiddens: list[torch.Tensor]) -> list[bytes]:
    """Proofs of several completions at once ([T_j, H] final-norm hidden states each).

    Vectorised: all chunks of all completions with the same k are interpolated together.
    """
    chunks: list[tuple[int, int, np.ndarray, np.ndarray]] = []  # (completion, chunk, idx, vals)
    for j, hidden in enumerate(hiddens):
        if hidden.dim() != 2:
            raise ValueError(f"hidden states must be [tokens, hidden], got {tuple(hidden.shape)}")
        top = _chunk_topk(hidden.detach().float().cpu())
        # NaN and inf rank above every finite magnitude, so checking the top-k suffices.
        if not all(np.isfinite(vals).all() for _, vals in top):
            raise ValueError(f"hidden states of completion {j} contain NaN/inf; no proof")
        chunks += [(j, c, idx, vals) for c, (idx, vals) in enumerate(top)]
    by_k: dict[int, list[int]] = {}
    for pos, chunk in enumerate(chunks):
        by_k.setdefault(chunk[2].size, []).append(pos)
    encoded: dict[tuple[int, int], bytes] = {}
    for positions in by_k.values():
        for g in range(0, len(positions), _GROUP):
            group = positions[g:g + _GROUP]
            idx = np.stack([chunks[p][2] for p in group]).astype(np.int64)
            moduli = _choose_moduli(idx)
            values = _to_fp16_bits(np.stack([chunks[p][3] for p in group]))
            coeffs = _interpolate(idx % moduli[:, None], values)
            rows = np.concatenate([moduli[:, None], coeffs], axis=1).astype("<u2")
            for p, row in zip(group, rows):
                encoded[chunks[p][:2]] = row.tobytes()
    out = []
    for j, hidden in enumerate(hiddens):
        n = len(chunk_layout(hidden.shape[0], hidden.shape[1]))
        out.append(bytes([FORMAT_VERSION]) + b"".join(encoded[(j, c)] for c in range(n)))
    return out


def build_proof(hidden: torch.Tensor) -> bytes:
    """Proof of one completion's final-norm hidden states [T, H] (one row per decoded token)."""
    return build_proofs([hidden])[0]


# Verify ----------------------------------------------------------------------------------


def verify_proof(proof: bytes, hidden: torch.Tensor,
                 thresholds: ProofThresholds | None = None) -> ProofResult:
    """Check `proof` against the verifier's own recomputed hidden states [T, H]. Total."""
    try:
        return _verify(proof, hidden, thresholds or ProofThresholds())
    except Exception as e:  # noqa: BLE001 - deliberate: always a verdict, counted as proof_error
        return ProofResult(False, "proof_error", f"{type(e).__name__}: {e}"[:200])


def _verify(proof: bytes, hidden: torch.Tensor, th: ProofThresholds) -> ProofResult:
    if not isinstance(proof, (bytes, bytearray, memoryview)):
        return ProofResult(False, "proof_missing", "proof is not bytes")
    proof = bytes(proof)
    if not isinstance(hidden, torch.Tensor) or hidden.dim() != 2:
        return ProofResult(False, "proof_hidden", "recomputed hidden states are not [T, H]")
    if len(proof) == 0:
        return ProofResult(False, "proof_missing", "empty proof")
    if proof[0] != FORMAT_VERSION:
        return ProofResult(False, "proof_version", f"format {proof[0]}, expected {FORMAT_VERSION}")
    t, h = hidden.shape
    layout = chunk_layout(t, h)
    expected = proof_size(t, h)
    if len(proof) != expected:
        full = 2 + 2 * min(TOP_K, CHUNK_TOKENS * h)
        extra = (len(proof) - expected) / full
        what = "too many chunks" if extra >= 1 else "too few chunks" if extra <= -1 else "bad size"
        return ProofResult(False, "proof_length",
                           f"{len(proof)} bytes, {t} tokens x {h} need {expected} ({what})")
    top = _chunk_topk(hidden.detach().float().cpu())
    # NaN and inf rank above every finite magnitude, so checking the top-k suffices.
    if not all(np.isfinite(vals).all() for _, vals in top):
        return ProofResult(False, "proof_hidden", "recomputed hidden states contain NaN/inf")
    words = np.frombuffer(proof, dtype="<u2", offset=1).astype(np.int64)
    starts = np.cumsum([0] + [1 + k for _, k in layout])[:-1]
    moduli = words[starts] if layout else np.zeros(0, dtype=np.int64)
    bad = np.flatnonzero((moduli < MIN_MODULUS) | (moduli > PRIME))
    if bad.size:
        return ProofResult(False, "proof_modulus", f"chunk {bad[0]}: modulus {moduli[bad[0]]}")
    coeff_mask = np.ones(words.size, dtype=bool)
    coeff_mask[starts] = False
    bad = np.flatnonzero((words >= PRIME) & coeff_mask)
    if bad.size:
        chunk = int(np.searchsorted(starts, bad[0], side="right")) - 1
        return ProofResult(False, "proof_coefficient", f"chunk {chunk}: coefficient >= {PRIME}")
    groups: dict[int, list[int]] = {}
    for i, (_, k) in enumerate(layout):
        groups.setdefault(k, []).append(i)
    claimed: dict[int, np.ndarray] = {}
    for k, members in groups.items():
        coeffs = np.stack([words[starts[i] + 1: starts[i] + 1 + k] for i in members])
        xs = np.stack([top[i][0] for i in members]).astype(np.int64) % moduli[members][:, None]
        for i, bits in zip(members, _evaluate(coeffs, xs)):
            claimed[i] = _from_fp16_bits(bits)
    canonical = np.zeros(len(layout), dtype=np.int64)
    for members in groups.values():
        canonical[members] = _choose_moduli(np.stack([top[i][0] for i in members]).astype(np.int64))
    result = ProofResult(True, "ok", chunks=len(layout))
    for i in range(len(layout)):
        actual = np.clip(top[i][1], -FP16_MAX, FP16_MAX)
        got = claimed[i]
        with np.errstate(invalid="ignore", over="ignore"):
            rel = (got - actual) / np.maximum(np.abs(actual), 2.0**-14)
            match = np.isfinite(got) & (np.sign(got) == np.sign(actual)) & (np.abs(rel) <= th.match_rel)
        mismatches = int((~match).sum())
        matched = rel[match]
        mean_abs = float(np.abs(matched).mean()) if matched.size else float("inf")
        bias = float(matched.mean()) if matched.size else float("inf")
        result.stats.append({"mismatches": mismatches, "mean_abs": mean_abs, "bias": bias})
        result.worst_mismatches = max(result.worst_mismatches, mismatches)
        result.worst_mean_abs = max(result.worst_mean_abs, mean_abs)
        result.worst_bias = max(result.worst_bias, abs(bias))
        max_mean_abs, max_bias = th.limits(layout[i][0])
        # the chunk's values against its limits (the benchmarks' calibration reads these)
        result.worst_mean_abs_ratio = max(result.worst_mean_abs_ratio, mean_abs / max_mean_abs)
        result.worst_bias_ratio = max(result.worst_bias_ratio, abs(bias) / max_bias)
        if not result.ok:
            continue
        if moduli[i] != canonical[i] and mismatches == 0:
            # Same top-k set, so the prover's canonical modulus is ours: a re-encoding.
            result.ok, result.reason = False, "proof_modulus"
            result.detail = f"chunk {i}: modulus {moduli[i]} is not canonical ({canonical[i]})"
        elif mismatches > th.max_mismatches:
            result.ok, result.reason = False, "proof_index_mismatch"
            result.detail = f"chunk {i}: {mismatches}/{match.size} values do not match"
        elif mean_abs > max_mean_abs:
            result.ok, result.reason = False, "proof_deviation"
            result.detail = f"chunk {i}: mean |rel err| {mean_abs:.2e} > {max_mean_abs:.2e}"
        elif abs(bias) > max_bias:
            result.ok, result.reason = False, "proof_bias"
            result.detail = f"chunk {i}: mean rel err {bias:+.2e}, limit {max_bias:.2e}"
    return result
