"""Per-peer sequential tests across batches: what the per-completion tolerances let through.

A tolerance sized for honest float differences (bf16: 0.1 nats) leaves room for two cheats
that no single completion reveals:

- logprob bias: every claimed logprob shifted the same way inside the tolerance. Honest
  errors (decode vs prefill, kernels, batch shapes) have no preferred sign, so the sign of
  a completion's mean error is a fair coin for an honest peer. Test: two one-sided Bernoulli
  CUSUMs on that sign (H0 p = 0.5, H1 p = `bias_p1`). Scale-free: no threshold to calibrate
  per model or dtype. (The trainer trains on the recomputed logprobs anyway; this catches
  the cheater and costs it its reputation.)
- near-tie steering: taking the runner-up token wherever the top two noisy scores are
  within `tie_eps`. At "wide" ties (margin in (tie_eps/4, tie_eps]) an honest sampler
  agrees with the verifier's own choice except for rare float reorderings (rate `flip_p0`,
  calibrated in benchmarks/verifier.py); a steering sender disagrees at rate `flip_p1` or
  more. Test: Bernoulli CUSUM (H0 flip_p0, H1 flip_p1) over wide ties.

CUSUM: g = max(0, g + LLR(observation)); an alarm when g > h, then g restarts at 0.
With h = 12 (log-likelihood units) the false-alarm bound is about e^-12 per start
(~6e-6); measured rates and detection delays: RESULTS.md "verifier". Peer records are an
LRU table of `max_peers`.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SequentialSettings:
    h: float = 12.0
    bias_p1: float = 0.9
    flip_p0: float = 0.05
    flip_p1: float = 0.5
    min_tokens: int = 8  # completions shorter than this say too little about the sign
    max_peers: int = 10_000


@dataclass
class _PeerState:
    bias_up: float = 0.0
    bias_down: float = 0.0
    steer: float = 0.0
    observed: int = 0
    alarms: dict = field(default_factory=dict)


class PeerMonitor:
    """Feeds each model-checked, accepted completion's stats into the peer's CUSUMs."""

    def __init__(self, settings: SequentialSettings | None = None):
        self.s = settings or SequentialSettings()
        s = self.s
        self._same = math.log(s.bias_p1 / 0.5)
        self._other = math.log((1 - s.bias_p1) / 0.5)
        self._flip = math.log(s.flip_p1 / s.flip_p0)
        self._keep = math.log((1 - s.flip_p1) / (1 - s.flip_p0))
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
        if n >= self.s.min_tokens and err != 0.0:
            up = err > 0
            st.bias_up = max(0.0, st.bias_up + (self._same if up else self._other))
            st.bias_down = max(0.0, st.bias_down + (self._other if up else self._same))
            if max(st.bias_up, st.bias_down) > self.s.h:
                alarm = "logprob_bias"
                st.bias_up = st.bias_down = 0.0
        ties, flips = stats.get("wide_ties", 0.0), stats.get("wide_flips", 0.0)
        if ties:
            st.steer = max(0.0, st.steer + flips * self._flip + (ties - flips) * self._keep)
            if st.steer > self.s.h:
                alarm = alarm or "tie_steering"
                st.steer = 0.0
        if alarm:
            st.alarms[alarm] = st.alarms.get(alarm, 0) + 1
        return alarm
