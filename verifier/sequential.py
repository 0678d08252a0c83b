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

- narrow ties (margin <= the wide threshold): honest floats reorder them often, so a
  steering sender hides there. They are watched per margin bin with the honest flip rate
  measured for the bin (`narrow`: (upper edge as a fraction of tie_eps, p0), from
  benchmarks/verifier_ties.py) against H1 `narrow_p1`; bins whose honest rate reaches it
  carry no evidence and are skipped. They have a CUSUM of their own (alarm `tie_steering`
  above h): in one statistic with the wide ties, the honest wide ties' strong downward
  drift would hide a sender steering only narrow ones.

CUSUM: g = max(0, g + LLR(observation)); an alarm when g > h, then g restarts at 0.
A peer an alarm condemned (`condemned`) is on probation again (reputation.py); until it
is out (`observe_batch(..., probation=False)`) its statistics start at, and never fall
below, `head_start` x h (a "fast initial response" CUSUM, Lucas & Crosier 1982, with
that as its floor): a steerer that goes on needs 40% of the evidence for its next alarm
(which bans it), and honest batches in between do not wash the head start out. An
honest peer falsely alarmed walks at its negative drift just above the floor: at the
measured bf16 rates it alarms again with about 1.3% over its probation (unit test), so
about 1e-6 per batch of honest peers are banned this way.
For the steering test h = 12 (log-likelihood units) bounds false alarms by about e^-12
per start (~6e-6; bf16 15; fp32 one flip, above); for the bias test an honest peer needs
a run of clipped 4-sigma completions to reach h. Measured, not only bounded: benchmarks/verifier_real.py `bootstrap`
feeds >= 40,000 honest batches per dtype, resampled from the measured honest completions,
to this code (0 alarms), and the same with each cheat applied (detection delays); RESULTS.md
"verifier-real". Peer records are an LRU table of `max_peers`.

Senders without verified history (`observe_batch(..., probation=True)`) face two more
tests, since a sybil that never sends twice never builds up a CUSUM:
- one batch alone: its steering and outlier log-likelihood ratios, each summed over the
  batch, alarm above `batch_h` (a likelihood-ratio test: an honest batch alarms with
  probability at most e^-batch_h, whatever the batch size); its bias z-scores, summed and
  divided by sqrt(count), alarm beyond +-`batch_z`;
- pooled: the same CUSUMs over the stream of every probation sender's completions (one
  "cohort" peer). An alarm there condemns each probation sender whose own evidence in the
  alarming excursion sums to more than `blame_min` (a likelihood ratio of e^blame_min
  against it alone), and nobody else: 3 sybils each steering one batch add up where none
  of them alone does, while an honest newcomer whose batch happened to fall into the
  excursion is not blamed for its few honest flips.
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
    # narrow ties: the verifier's tie_eps (0: not watched) and per margin bin (upper edge as
    # a fraction of tie_eps, ascending, up to the wide threshold; honest flip rate p0)
    tie_eps: float = 0.0
    narrow: tuple[tuple[float, float], ...] = ()
    narrow_p1: float = 0.6  # H1 of the narrow bins (a steering sender flips most of them)
    # senders without history: one batch's own evidence (likelihood ratio; bias z)
    batch_h: float = 11.0
    batch_z: float = 4.5
    pooled: bool = True  # the cohort CUSUMs over every probation sender
    max_blame: int = 1024  # senders remembered per pooled excursion
    blame_min: float = 3.0  # a pooled alarm condemns senders whose own share exceeds this
    # a condemned peer's CUSUMs restart at (and stay above) this fraction of h: 0.5 let a
    # weakly steered batch (11 positions) slip through on the real bf16 trainer; 0.6 makes
    # one with 5-12 steered narrow ties alarm 79% of the time (0.5: 53%) at 1.3% re-alarms
    # of honest condemned peers over their 64-completion probation (0.5: 0.2%; unit test)
    head_start: float = 0.6

    @classmethod
    def for_dtype(cls, dtype: str) -> SequentialSettings:
        """Honest parameters measured on SmolLM2 (CPU), benchmarks/verifier.py --real."""
        if dtype in ("bfloat16", "float16"):
            return cls(bias_mu=BF16_BIAS_MU, bias_sigma=BF16_BIAS_SIGMA, flip_p0=BF16_FLIP_P0,
                       steer_h=BF16_STEER_H, tie_eps=BF16_TIE_EPS, narrow=BF16_NARROW)
        return cls(flip_p0=FP32_FLIP_P0, steer_h=FP32_STEER_H, tie_eps=FP32_TIE_EPS,
                   narrow=FP32_NARROW)


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
# the verifiers' tie_eps per dtype (checks.CheckSettings.for_dtype)
FP32_TIE_EPS, BF16_TIE_EPS = 1e-3, 0.4
# narrow ties (margin <= tie_eps / 4), per bin (edge / tie_eps, honest flip rate p0).
# bf16: SmolLM2 (CPU, 1,120 honest completions of 8 tokens, batch 32, T = 1; this session,
# benchmarks/verifier_ties.py): 139 of 570 narrow ties flipped (24%; per bin 12-30%, no
# trend with the margin), so one bin with p0 0.3 (wide ties: 53 of 1,457, 3.6%; p0 0.1).
# fp32: not counted (session 8, RESULTS.md "verifier-real": ties above 1e-4 pushed the
# stress false-alarm rate to 1.3e-4 per batch; below 1e-4 honest pair errors reach them).
FP32_NARROW: tuple[tuple[float, float], ...] = ()
BF16_NARROW: tuple[tuple[float, float], ...] = ((0.25, 0.3),)


@dataclass
class _PeerState:
    bias_up: float = 0.0
    bias_down: float = 0.0
    steer: float = 0.0
    narrow: float = 0.0
    outlier: float = 0.0
    observed: int = 0
    alarms: dict = field(default_factory=dict)
    condemned: bool = False  # floors at head_start x h until out of probation


@dataclass(frozen=True)
class Alarm:
    """A sequential test's verdict on one batch: `reason` (PEER_REASONS), the `peers` it
    condemns (those of every test that fired on the batch), and which `test` fired first:
    "peer" (the sender's CUSUM), "batch" (one batch of a sender without history) or
    "pooled" (the probation cohort)."""

    reason: str
    peers: tuple[str, ...]
    test: str


@dataclass
class _Evidence:
    """One completion's log-likelihood ratios (and the clipped bias z, or None)."""

    steer: float = 0.0
    narrow: float = 0.0
    outlier: float | None = None
    z: float | None = None


_STATS = ("bias_up", "bias_down", "steer", "narrow", "outlier")
_REASON = {"bias_up": "logprob_bias", "bias_down": "logprob_bias", "steer": "tie_steering",
           "narrow": "tie_steering", "outlier": "tie_steering"}
COHORT = "*probation*"  # the pooled state's key (not a peer id: those are base58)


class PeerMonitor:
    """Feeds each model-checked, accepted completion's stats into the peer's CUSUMs (and,
    for senders without history, into the one-batch and pooled tests)."""

    def __init__(self, settings: SequentialSettings | None = None):
        self.s = settings or SequentialSettings()
        s = self.s
        self._flip = math.log(s.flip_p1 / s.flip_p0)
        self._keep = math.log((1 - s.flip_p1) / (1 - s.flip_p0))
        self._outlier = math.log(s.outlier_p1 / s.outlier_p0)
        self._clean = math.log((1 - s.outlier_p1) / (1 - s.outlier_p0))
        self._steer_h = s.steer_h or s.h
        self._wide = s.wide_min or s.tie_eps / 4
        self._floors = {k: s.head_start * h for k, h in self._thresholds().items()}
        # narrow bins: (upper margin, LLR of a flip, LLR of a kept tie); uninformative skipped
        self._narrow = [(edge * s.tie_eps, math.log(s.narrow_p1 / p0),
                         math.log((1 - s.narrow_p1) / (1 - p0)))
                        for edge, p0 in s.narrow if 0 < p0 < s.narrow_p1]
        self.peers: OrderedDict[str, _PeerState] = OrderedDict()
        self.cohort = _PeerState()
        # per pooled statistic: sender -> its evidence in the current excursion
        self.blame: dict[str, OrderedDict[str, float]] = {k: OrderedDict() for k in _STATS}
        self.pooled_alarms = 0

    def _state(self, peer: str) -> _PeerState:
        st = self.peers.get(peer)
        if st is None:
            st = self.peers[peer] = _PeerState()
            while len(self.peers) > self.s.max_peers:
                self.peers.popitem(last=False)
        self.peers.move_to_end(peer)
        return st

    # evidence of one completion ------------------------------------------------------------

    def _evidence(self, stats: dict) -> _Evidence:
        s = self.s
        ev = _Evidence()
        n = stats.get("lp_n", 0.0)
        if n >= s.min_tokens:
            z = (stats.get("lp_err_sum", 0.0) - s.bias_mu * n) / (s.bias_sigma * math.sqrt(n))
            ev.z = max(-s.bias_clip, min(s.bias_clip, z))
        margins = stats.get("tie_margins")
        if margins is not None and (s.wide_min or s.tie_eps):
            for m, flipped in zip(margins, stats["tie_flipped"]):
                if m > self._wide:
                    ev.steer += self._flip if flipped else self._keep
                    continue
                for edge, flip, keep in self._narrow:
                    if m <= edge:
                        ev.narrow += flip if flipped else keep
                        break
        else:
            ties, flips = stats.get("wide_ties", 0.0), stats.get("wide_flips", 0.0)
            ev.steer = flips * self._flip + (ties - flips) * self._keep
        if "replay_outliers" in stats:
            ev.outlier = self._outlier if stats["replay_outliers"] > 0 else self._clean
        return ev

    def _update(self, st: _PeerState, ev: _Evidence) -> dict[str, float]:
        """Apply one completion's evidence to `st`; returns each statistic's step (the
        change it made, 0 where it was clamped at 0) and leaves an alarming one above h."""
        s = self.s
        before = {k: getattr(st, k) for k in _STATS}
        low = self._floors if st.condemned else dict.fromkeys(_STATS, 0.0)
        st.observed += 1
        if ev.z is not None:
            st.bias_up = max(low["bias_up"], st.bias_up + ev.z - s.bias_k)
            st.bias_down = max(low["bias_down"], st.bias_down - ev.z - s.bias_k)
        st.steer = max(low["steer"], st.steer + ev.steer)
        st.narrow = max(low["narrow"], st.narrow + ev.narrow)
        if ev.outlier is not None:
            st.outlier = max(low["outlier"], st.outlier + ev.outlier)
        return {k: getattr(st, k) - before[k] for k in _STATS}

    def _thresholds(self) -> dict[str, float]:
        return {"bias_up": self.s.h, "bias_down": self.s.h, "steer": self._steer_h,
                "narrow": self.s.h, "outlier": self.s.h}

    def _fired(self, st: _PeerState) -> list[str]:
        """Statistics above their threshold (restarted at 0, or a condemned peer's
        floor)."""
        h = self._thresholds()
        low = self._floors if st.condemned else dict.fromkeys(_STATS, 0.0)
        out = [k for k in _STATS if getattr(st, k) > h[k]]
        if "bias_up" in out or "bias_down" in out:
            st.bias_up, st.bias_down = low["bias_up"], low["bias_down"]
        for k in out:
            setattr(st, k, low[k])
        return out

    # public --------------------------------------------------------------------------------

    def observe(self, peer: str, stats: dict) -> str | None:
        """Update `peer`'s CUSUMs with one completion's stats (`lp_err_sum`, `lp_n`,
        `tie_margins`/`tie_flipped` or `wide_ties`/`wide_flips`, `replay_outliers` from
        RolloutVerifier). Returns a reason code on an alarm, else None."""
        st = self._state(peer)
        self._update(st, self._evidence(stats))
        fired = self._fired(st)
        alarm = _REASON[fired[0]] if fired else None
        if alarm:
            st.alarms[alarm] = st.alarms.get(alarm, 0) + 1
        return alarm

    def observe_batch(self, peer: str, stats: list[dict], probation: bool) -> Alarm | None:
        """One verified batch's model-checked, accepted completions (their stats), in order.
        Every test sees all of them; the first alarm's reason and test are returned (the
        sender's own CUSUM first, then the one-batch test, then the pooled one), with the
        peers of every alarm of the batch."""
        evidence = [self._evidence(x) for x in stats]
        st = self._state(peer)
        if not probation:
            st.condemned = False  # out of probation again (reputation.py): no floor
        fired: list[tuple[str, str, tuple[str, ...]]] = []
        for ev in evidence:
            self._update(st, ev)
            fired += [(_REASON[k], "peer", (peer,)) for k in self._fired(st)]
        if probation and evidence:
            reason = self._one_batch(evidence)
            if reason:
                fired.append((reason, "batch", (peer,)))
            if self.s.pooled:
                fired += self._pool(peer, evidence)
        if not fired:
            return None
        reason, test, _ = fired[0]
        st.alarms[reason] = st.alarms.get(reason, 0) + 1
        # every sender any test condemned in this batch: a pooled alarm that fires with the
        # sender's own (the CUSUMs restarted, their excursion's blame is spent) must not
        # lose the other senders it blames
        peers = tuple(dict.fromkeys(p for _, _, condemned in fired for p in condemned))
        return Alarm(reason, peers, test)

    def condemned(self, peer: str) -> None:
        """An alarm condemned `peer` (whichever test fired): each of its statistics
        restarts at `head_start` x its threshold (or stays where it is if higher) and
        stays at or above that until a batch of it is observed out of probation."""
        st = self._state(peer)
        st.condemned = True
        for k, low in self._floors.items():
            setattr(st, k, max(getattr(st, k), low))

    def _one_batch(self, evidence: list[_Evidence]) -> str | None:
        s = self.s
        zs = [ev.z for ev in evidence if ev.z is not None]
        if zs and abs(sum(zs)) / math.sqrt(len(zs)) > s.batch_z:
            return "logprob_bias"
        if sum(ev.steer for ev in evidence) > s.batch_h:
            return "tie_steering"
        if sum(ev.narrow for ev in evidence) > s.batch_h:
            return "tie_steering"
        if sum(ev.outlier or 0.0 for ev in evidence) > s.batch_h:
            return "tie_steering"
        return None

    def _pool(self, peer: str, evidence: list[_Evidence]) -> list[tuple[str, str, tuple]]:
        """The cohort CUSUMs over the batch, each sender's share of the current excursion
        kept; checked once the whole batch is in (its sender's share complete). An alarm
        blames the senders whose share exceeds `blame_min` (none: it only restarts)."""
        for ev in evidence:
            step = self._update(self.cohort, ev)
            for k in _STATS:
                shares = self.blame[k]
                if getattr(self.cohort, k) == 0.0:
                    shares.clear()  # the excursion ended: nobody's evidence is in it
                elif step[k]:
                    shares[peer] = shares.get(peer, 0.0) + step[k]
                    shares.move_to_end(peer)
                    while len(shares) > self.s.max_blame:
                        shares.popitem(last=False)
        out = []
        for k in self._fired(self.cohort):
            guilty = tuple(p for p, v in self.blame[k].items() if v > self.s.blame_min)
            for kk in (("bias_up", "bias_down") if k.startswith("bias") else (k,)):
                self.blame[kk].clear()
            self.pooled_alarms += 1
            if guilty:
                out.append((_REASON[k], "pooled", guilty))
        return out
