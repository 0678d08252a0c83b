"""Per-peer sequential tests across batches: what the per-completion tolerances let through.

A tolerance sized for honest float differences (bf16: 1 nat) leaves room for two cheats
that no single completion reveals:

- logprob bias: every claimed logprob shifted the same way inside the tolerance. Honest
  bf16 errors need not be zero-mean (the sampler's own rounding helped pick the token it
  took); measured on SmolLM2 (CPU, 180 completions in session 4): mean +0.0021 nats per
  token, per-token spread 0.058 (27 completions of session 3: +0.002, 0.054). Test: per
  completion z = (sum err - mu0 n) / (sigma0 sqrt n), clipped to +-`bias_clip`, with mu0 and sigma0
  per dtype from the calibration (`for_dtype`); a two-sided CUSUM with allowance `bias_k`.
  (The trainer trains on the recomputed logprobs anyway; this catches the cheater and costs
  it its reputation.)
- near-tie steering: taking the runner-up token wherever the top two noisy scores are
  within `tie_eps`. At "wide" ties (margin in (tie_eps/4, tie_eps]) an honest sampler
  agrees with the verifier's own choice except for rare float reorderings (rate `flip_p0`);
  a steering sender disagrees at rate `flip_p1` or more. Test: Bernoulli CUSUM (H0
  flip_p0, H1 flip_p1) over wide ties. An honest flip at a tie of margin m needs the
  sampler's and the verifier's score differences of the two tokens to differ by >= m.
  bf16: honest flips at wide ties were measured (13 of 427 on SmolLM2), p0 0.1. fp32:
  a wide tie has m > 2.5e-4, while the sampler's decode and the verifier's prefill differ
  on the verifier's top two by at most 5.2e-5 on SmolLM2 (CPU, 16,913 honest positions in
  5 configurations, session 8; benchmarks/verifier_real.py `flip_errors`): an honest flip
  needs a pair error ~5x the worst seen, and none was seen; p0 = 3 / 16,913 = 1.8e-4 is
  the 95% bound, and one flipped wide tie alarms (`steer_h` just below log(p1 / p0)). A
  steering sender is caught in the batch of its first steered wide tie; before that it has
  none to steer (~0.11 per batch of 8, ~0.46 per batch of 32), so from the first batch
  a batch-8 cheater steering every wide tie alarms after 7 / 25 batches (median / 95th
  percentile; batch 32: 2 / 7). Honest peers flipping wide ties at p0 itself alarm at
  ~7.5e-5 per batch (bootstrap, RESULTS.md "verifier-real", session 8); at 1e-3 (5.6x p0)
  5.5e-4 per batch of 32: the test rests on fp32 pair errors staying well below 2.5e-4,
  which other fp32 hardware's summation orders should not change (error ~ eps x sqrt(K)),
  but TF32 or reduced-precision kernels would. (Session 7's test, p0 1e-3 and two flips,
  on the same data: 14 / 37.) `wide_min` counts narrower ties too (measured, not used).
- replay outliers (bf16): one position per completion may trail the seeded choice by up
  to `replay_outlier_eps` (checks.py). Honest rate measured 1 in 600 bf16 completions
  (session 6; a 63-token one; session 5's top-p outliers were the top-p cut moving and are
  gone with checks._masks); p0 0.02; a sender using the outlier in half its completions
  or more alarms within a batch of 32 (Bernoulli CUSUM per completion).

CUSUM: g = max(0, g + LLR(observation)); an alarm when g > h, then g restarts at 0.
For the steering test h = 12 (log-likelihood units) bounds false alarms by about e^-12
per start (~6e-6; bf16 15; fp32 one flip, above); for the bias test an honest peer needs
a run of clipped 4-sigma completions to reach h. Measured, not only bounded: benchmarks/verifier_real.py `bootstrap`
feeds >= 40,000 honest batches per dtype, resampled from the measured honest completions,
to this code (0 alarms), and the same with each cheat applied (detection delays); RESULTS.md
"verifier-real". Peer records are an LRU table of `max_peers`.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SequentialSettings:
    h: float = 12.0
    bias_mu: float = 0.0  # honest mean error per token (claimed - recomputed)
    bias_sigma: float = 5e-5  # honest per-token spread (fp32: a floor at logprob_tol / 20)
    bias_k: float = 1.5  # CUSUM allowance, in sigmas
    bias_clip: float = 4.0  # one completion moves the statistic by at most this
    flip_p0: float = 0.05  # uncalibrated default; for_dtype gives the measured ones
    flip_p1: float = 0.5
    steer_h: float = 0.0  # alarm threshold of the steering CUSUM (0: h)
    # ties the steering test counts: margin in (wide_min, tie_eps], from the stats'
    # `tie_margins` / `tie_flipped`; 0: the verifier's wide ties (`wide_ties`, tie_eps / 4)
    wide_min: float = 0.0
    min_tokens: int = 8  # shorter completions are not used for the bias test
    # completions with a replay outlier (checks.CheckSettings.replay_outlier_eps): honest
    # rate at most outlier_p0; a sender using its one outlier per completion to steer does so
    # at rate outlier_p1 or more. Bernoulli CUSUM per completion, alarm `tie_steering`.
    outlier_p0: float = 0.02
    outlier_p1: float = 0.5
    max_peers: int = 10_000

    @classmethod
    def for_dtype(cls, dtype: str) -> SequentialSettings:
        """Honest parameters measured on SmolLM2 (CPU), benchmarks/verifier.py --real."""
        if dtype in ("bfloat16", "float16"):
            return cls(bias_mu=BF16_BIAS_MU, bias_sigma=BF16_BIAS_SIGMA, flip_p0=BF16_FLIP_P0,
                       steer_h=BF16_STEER_H)
        return cls(flip_p0=FP32_FLIP_P0, steer_h=FP32_STEER_H)


# fp32: honest flip rate at wide ties (margin > tie_eps / 4 = 2.5e-4): the 95% bound 3 / N
# when none of N measured honest positions has a pair error above that margin (session 8:
# N = 16,913, max 5.2e-5; module docstring, RESULTS.md "verifier-real")
FP32_FLIP_P0 = 3 / 16_913
# just below one flip's evidence log(p1 / p0) = 7.95: one flipped wide tie alarms
FP32_STEER_H = math.log(0.5 / FP32_FLIP_P0) - 0.5
# bf16 honest calibration (SmolLM2-135M, CPU; RESULTS.md "verifier-real")
BF16_BIAS_MU = 0.002
BF16_BIAS_SIGMA = 0.06
BF16_FLIP_P0 = 0.1
# bf16 steering alarm threshold (h 12 elsewhere). Honest peers whose floats flipped wide
# ties 0.1 more often than measured (34 of 1,110, ~3%; the 99.9% bound is 5%) alarmed at
# 3e-4 per batch of 32 with h 12; with 15, 0 in 40,000 (batch 32) and 1 (batch 8), while a
# cheater steering half the wide ties is caught in at most 2 (batch 32) / 4 (batch 8)
# batches at the 95th percentile (bootstrap, session 7, RESULTS.md "verifier-real")
BF16_STEER_H = 15.0


@dataclass
class _PeerState:
    bias_up: float = 0.0
    bias_down: float = 0.0
    steer: float = 0.0
    outlier: float = 0.0
    observed: int = 0
    alarms: dict = field(default_factory=dict)


class PeerMonitor:
    """Feeds each model-checked, accepted completion's stats into the peer's CUSUMs."""

    def __init__(self, settings: SequentialSettings | None = None):
        self.s = settings or SequentialSettings()
        s = self.s
        self._flip = math.log(s.flip_p1 / s.flip_p0)
        self._keep = math.log((1 - s.flip_p1) / (1 - s.flip_p0))
        self._outlier = math.log(s.outlier_p1 / s.outlier_p0)
        self._clean = math.log((1 - s.outlier_p1) / (1 - s.outlier_p0))
        self._steer_h = s.steer_h or s.h
        self.peers: OrderedDict[str, _PeerState] = OrderedDict()

    def _state(self, peer: str) -> _PeerState:
        st = self.peers.get(peer)
        if st is None:
            st = self.peers[peer] = _PeerState()
            while len(self.peers) > self.s.max_peers:
                self.peers.popitem(last=False)
        self.peers.move_to_end(peer)
        return st

    def observe(self, peer: str, stats: dict) -> str | None:
        """Update with one completion's stats (`lp_err_sum`, `lp_n`, `wide_ties`,
        `wide_flips` from RolloutVerifier). Returns a reason code on an alarm, else None."""
        st = self._state(peer)
        st.observed += 1
        alarm = None
        n = stats.get("lp_n", 0.0)
        err = stats.get("lp_err_sum", 0.0)
        s = self.s
        if n >= s.min_tokens:
            z = (err - s.bias_mu * n) / (s.bias_sigma * math.sqrt(n))
            z = max(-s.bias_clip, min(s.bias_clip, z))
            st.bias_up = max(0.0, st.bias_up + z - s.bias_k)
            st.bias_down = max(0.0, st.bias_down - z - s.bias_k)
            if max(st.bias_up, st.bias_down) > s.h:
                alarm = "logprob_bias"
                st.bias_up = st.bias_down = 0.0
        if s.wide_min and "tie_margins" in stats:
            watched = [f for m, f in zip(stats["tie_margins"], stats["tie_flipped"])
                       if m > s.wide_min]
            ties, flips = len(watched), sum(watched)
        else:
            ties, flips = stats.get("wide_ties", 0.0), stats.get("wide_flips", 0.0)
        if ties:
            st.steer = max(0.0, st.steer + flips * self._flip + (ties - flips) * self._keep)
            if st.steer > self._steer_h:
                alarm = alarm or "tie_steering"
                st.steer = 0.0
        if "replay_outliers" in stats:
            hit = stats["replay_outliers"] > 0
            st.outlier = max(0.0, st.outlier + (self._outlier if hit else self._clean))
            if st.outlier > self.s.h:
                alarm = alarm or "tie_steering"
                st.outlier = 0.0
        if alarm:
            st.alarms[alarm] = st.alarms.get(alarm, 0) + 1
        return alarm
