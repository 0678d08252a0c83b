"""Per-peer reputation from verdicts: decaying score, timed bans, spot-check fractions.

A peer's score moves by a weight per verdict (accept: +1; reject: a penalty by reason) and
decays toward 0 with a half-life, so old behaviour fades. A peer whose score drops below
`ban_threshold` is banned for `ban_seconds` (its messages are dropped at the gossip
validator). New peers (fewer than `new_peer_verdicts` verdicts) and low scorers are always
verified; trusted peers are spot-checked at `spot_check_fraction`, picked by a keyed hash of
the rollout id that the peer cannot predict.

Verdicts received from other peers are hints only: they make the subject "suspect" (every
rollout verified) for a while, never change its score or ban it, since they are not
verifiable without the rollout.

State is a JSON file replaced atomically (write temp, fsync, rename), so a crash leaves
either the old or the new state; an unreadable file is moved aside and the node starts
fresh.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from .reasons import CONFIG_REASONS

log = logging.getLogger(__name__)

STATE_VERSION = 1
ACCEPT_WEIGHT = 1.0
MAX_SCORE = 20.0
DEFAULT_PENALTY = -5.0
# Penalties by reject reason: evidence of cheating is heavy; what an honest but slow or
# misconfigured peer can produce (stale policy, duplicates) is light.
PENALTIES: dict[str, float] = {
    "stale_policy": -0.5,
    "unknown_policy": -0.5,
    "wrong_swarm": -0.5,
    "duplicate": -1.0,
    "round_reused": -1.0,
    "verifier_error": 0.0,  # our fault, not the peer's
    "over_budget": 0.0,  # not verified at all
    "group_member_rejected": 0.0,  # collateral of a sibling's reject, which is penalised
    **{reason: 0.0 for reason in CONFIG_REASONS},  # honest misconfiguration: never punished
}


@dataclass
class PeerRecord:
    score: float = 0.0
    updated: float = 0.0
    accepted: int = 0
    rejected: int = 0
    banned_until: float = 0.0
    suspect_until: float = 0.0
    last_reason: str = ""


class Reputation:
    def __init__(self, path: str | os.PathLike | None, *, ban_threshold: float = -5.0,
                 ban_seconds: float = 3600.0, half_life_s: float = 3600.0,
                 spot_check_fraction: float = 1.0, new_peer_verdicts: int = 20,
                 trust_score: float = 5.0, suspect_seconds: float = 600.0,
                 max_peers: int = 100_000, save_interval_s: float = 5.0,
                 clock: Callable[[], float] = time.time):
        self.path = Path(path) if path is not None else None
        self.ban_threshold = ban_threshold
        self.ban_seconds = ban_seconds
        self.half_life_s = half_life_s
        self.spot_check_fraction = spot_check_fraction
        self.new_peer_verdicts = new_peer_verdicts
        self.trust_score = trust_score
        self.suspect_seconds = suspect_seconds
        self.max_peers = max_peers
        self.save_interval_s = save_interval_s
        self.clock = clock
        self.peers: dict[str, PeerRecord] = {}
        self.secret = secrets.token_bytes(16)
        self.hints = 0
        self._dirty = False
        self._last_save = 0.0
        self._load()

    @classmethod
    def from_config(cls, section, path: str | os.PathLike | None) -> Reputation:
        """Build from a `VerifierSection`."""
        return cls(path, ban_threshold=section.ban_threshold, ban_seconds=section.ban_seconds,
                   half_life_s=section.reputation_half_life_s,
                   spot_check_fraction=section.spot_check_fraction,
                   new_peer_verdicts=section.new_peer_verdicts,
                   trust_score=section.trust_score, suspect_seconds=section.hint_suspect_seconds)

    # scores ------------------------------------------------------------------------------

    def _decayed(self, rec: PeerRecord, now: float) -> float:
        if self.half_life_s <= 0 or now <= rec.updated:
            return rec.score
        return rec.score * math.pow(0.5, (now - rec.updated) / self.half_life_s)

    def score(self, peer: str) -> float:
        rec = self.peers.get(peer)
        return self._decayed(rec, self.clock()) if rec else 0.0

    def record(self, peer: str, accepted: bool, reason: str = "ok") -> float:
        """Apply one verdict about `peer`; returns the new score. Bans when it drops below
        the threshold."""
        now = self.clock()
        rec = self.peers.get(peer)
        if rec is None:
            self._make_room()
            rec = self.peers[peer] = PeerRecord(updated=now)
        weight = ACCEPT_WEIGHT if accepted else PENALTIES.get(reason, DEFAULT_PENALTY)
        rec.score = min(MAX_SCORE, self._decayed(rec, now) + weight)
        rec.updated = now
        rec.last_reason = reason
        if accepted:
            rec.accepted += 1
        else:
            rec.rejected += 1
        self._dirty = True
        if rec.score < self.ban_threshold and rec.banned_until <= now:
            rec.banned_until = now + self.ban_seconds
            log.warning("banned peer %s for %.0f s (score %.2f, last reason %s)",
                        peer, self.ban_seconds, rec.score, reason)
            self.save()
        else:
            self.maybe_save()
        return rec.score

    def is_banned(self, peer: str) -> bool:
        rec = self.peers.get(peer)
        return rec is not None and rec.banned_until > self.clock()

    def banned(self) -> list[str]:
        now = self.clock()
        return sorted(p for p, r in self.peers.items() if r.banned_until > now)

    def unban(self, peer: str) -> None:
        rec = self.peers.get(peer)
        if rec is not None:
            rec.banned_until = 0.0
            rec.score = max(rec.score, self.ban_threshold)
            self.save()

    # spot checks -------------------------------------------------------------------------

    def check_fraction(self, peer: str) -> float:
        """Fraction of `peer`'s rollouts to verify: 1 for new, low-score or suspect peers."""
        rec = self.peers.get(peer)
        now = self.clock()
        if rec is None or rec.accepted + rec.rejected < self.new_peer_verdicts:
            return 1.0
        if rec.suspect_until > now or self._decayed(rec, now) < self.trust_score:
            return 1.0
        return self.spot_check_fraction

    def should_verify(self, peer: str, rollout_id: bytes) -> bool:
        """Spot-check decision, keyed by a local secret so the peer cannot predict it."""
        fraction = self.check_fraction(peer)
        if fraction >= 1.0:
            return True
        if fraction <= 0.0:
            return False
        h = hashlib.blake2b(rollout_id, key=self.secret, digest_size=8).digest()
        return int.from_bytes(h, "little") / 2**64 < fraction

    def hint(self, verdict, from_peer: str) -> bool:
        """A `Verdict` published by another peer. Rejects make the subject suspect (always
        verified) for `suspect_seconds`; nothing else changes. Returns whether it was used."""
        if verdict.accept or self.is_banned(from_peer) or verdict.subject == from_peer:
            return False
        self.hints += 1
        rec = self.peers.get(verdict.subject)
        if rec is None:
            self._make_room()
            rec = self.peers[verdict.subject] = PeerRecord(updated=self.clock())
        rec.suspect_until = max(rec.suspect_until, self.clock() + self.suspect_seconds)
        self._dirty = True
        self.maybe_save()
        return True

    # persistence -------------------------------------------------------------------------

    def _make_room(self) -> None:
        if len(self.peers) < self.max_peers:
            return
        now = self.clock()
        # Forget the unbanned peer with the least at stake (smallest |score|).
        candidates = [(abs(self._decayed(r, now)), p) for p, r in self.peers.items()
                      if r.banned_until <= now]
        if candidates:
            del self.peers[min(candidates)[1]]

    def maybe_save(self) -> None:
        if self._dirty and self.clock() - self._last_save >= self.save_interval_s:
            self.save()

    def save(self) -> None:
        """Write the state atomically (no-op without a path)."""
        self._last_save = self.clock()
        if self.path is None:
            self._dirty = False
            return
        state = {"version": STATE_VERSION, "secret": self.secret.hex(),
                 "peers": {p: asdict(r) for p, r in self.peers.items()}}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + f".tmp{os.getpid()}")
        with open(tmp, "w") as f:
            json.dump(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        try:
            fd = os.open(self.path.parent, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError:
            pass
        self._dirty = False

    def _load(self) -> None:
        if self.path is None or not self.path.exists():
            return
        try:
            state = json.loads(self.path.read_text())
            if state.get("version") != STATE_VERSION:
                raise ValueError(f"state version {state.get('version')!r}")
            peers = {str(p): PeerRecord(**{k: (str(v) if k == "last_reason" else float(v)
                                                 if k not in ("accepted", "rejected") else int(v))
                                           for k, v in r.items()})
                     for p, r in state["peers"].items()}
            secret = bytes.fromhex(state["secret"])
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            aside = self.path.with_name(self.path.name + ".corrupt")
            log.error("reputation file %s is unreadable (%s); moved to %s, starting fresh",
                      self.path, e, aside)
            os.replace(self.path, aside)
            return
        self.peers = peers
        self.secret = secret
