"""Per-peer reputation from verdicts: decaying score, timed bans, spot-check fractions.

A peer's score moves by a weight per verdict (accept: +1; reject: a penalty by reason) and
decays toward 0 with a half-life, so old behaviour fades. A peer whose score drops below
`ban_threshold` is banned for `ban_seconds` (its messages are dropped at the gossip
validator). New peers (fewer than `new_peer_verdicts` verdicts) and low scorers are always
verified; trusted peers are spot-checked at `spot_check_fraction`, picked by a keyed hash of
the rollout id that the peer cannot predict.

A per-peer test's alarm (sequential.py: `logprob_bias`, `tie_steering`) is not one more
reject: `record_alarm` bans a peer without verified history outright and costs an
established one `ALARM_PENALTY` (the score cap: banned unless it was at the cap), and the
intake discards the alarmed batch, so an alarm always costs more than the batch earned.
An alarm also restarts the peer's probation and raises what ends it: only completions
accepted after its last alarm count, and it needs `probation_accepts` x
`REPROBATION_FACTOR`^alarms of them (8, 64, then 512 at most). Until then it is a
probation sender (one-batch and pooled tests, and its next alarm bans it): a caught
steerer cannot buy its standing back with one honest batch (issue 30). One alarm on record
is forgiven per `alarm_forgive_s` (the config's verifier.alarm_forgive_s, a day) since the
last one, so an honest peer's rare false alarm does not keep it on a long probation for
good. `reprobation(peer)` (an alarm on record, probation not yet served) is what keeps its
sequential tests at their head start: derived from the persisted record, it survives a
restart.

Verdicts received from other peers are hints only, and only from a peer the caller trusts
(`hint(..., trusted=...)`: one with verified history here, or a followed trainer): such a
reject makes the subject "suspect", so every rollout of it is verified (no spot checks)
for `suspect_seconds`. Nothing else changes: not its score, not its ban, not whether it is
established (its place in the verification queue). A verdict from anyone else changes
nothing at all, so a fresh key cannot demote an honest peer. Suspects live in their own
small LRU table (not persisted, `max_suspects`), so a flood of verdicts about made-up
subjects costs O(1) each and bounded memory. The peer table is LRU too (`max_peers`;
banned peers are kept while banned).

State: a JSON snapshot replaced atomically (write temp, fsync, rename) plus an append-only
journal `<name>.log` of changed records (one JSON line each, fsynced): a ban writes one
line, not the whole table; the journal is folded into a new snapshot when it grows past
`max(4096, 2 x peers)` lines. A torn last journal line is ignored; an unreadable snapshot
is moved aside and the node starts fresh.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import math
import os
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from ..node.config import VerifierSection
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
    "already_accepted": 0.0,  # the same batch again: a re-delivery, not the sender's doing
    "verifier_error": 0.0,  # our fault, not the peer's
    "over_budget": 0.0,  # not verified at all
    "queue_expired": 0.0,  # waited in our queue too long: our doing, not the peer's
    "group_member_rejected": 0.0,  # collateral of a sibling's reject, which is penalised
    "batch_member_rejected": 0.0,  # not checked: the batch's probe group failed (penalised)
    **{reason: 0.0 for reason in CONFIG_REASONS},  # honest misconfiguration: never punished
}
# A per-peer test's alarm on an established peer: the whole score cap, more than any batch
# earns (its accepted completions are discarded with it anyway). A peer at the cap falls to
# 0 (probation again, not banned: an honest false alarm costs it its standing, ~1e-4 per
# batch); any peer with a shorter history falls below the ban threshold.
ALARM_PENALTY = -MAX_SCORE
# After an alarm, probation needs this many times more accepted completions (per alarm on
# record, at most REPROBATION_MAX_POWER times): a false alarm of an honest peer (~1e-4 per
# batch) costs it 8 batches of 8 under full verification. x4 was too little against the
# real bf16 trainer: one honest batch and one weakly steered batch that slipped under the
# restarted tests (16 + 16 completions) made a caught steerer established again.
REPROBATION_FACTOR = 8
REPROBATION_MAX_POWER = 2
# One alarm on record is forgiven per this many seconds since the peer's last alarm (the
# default of the config's verifier.alarm_forgive_s). Honest false alarms are <= ~1e-4 per
# batch (sequential.py; fp32 measured 7.5e-5): a peer sending
# a batch every 10 s (8,640 a day) collects <= ~0.9 a day, so forgiving one a day keeps an
# honest record at about one (re-probation 64 completions) instead of climbing to the 512 of
# the cap and staying there. An attacker gains nothing by waiting: a fresh key (free) starts
# with no alarm on record anyway; what an alarm costs it at once (ban or the score cap,
# its batch and its waiting groups) is unchanged.
ALARM_FORGIVE_S = VerifierSection.model_fields["alarm_forgive_s"].default


@dataclass
class PeerRecord:
    score: float = 0.0
    updated: float = 0.0
    accepted: int = 0
    rejected: int = 0
    banned_until: float = 0.0
    last_reason: str = ""
    alarms: int = 0  # per-peer test alarms on record (one forgiven per alarm_forgive_s)
    accepted_at_alarm: int = 0  # `accepted` at the last alarm (only later ones count)
    alarm_at: float = 0.0  # time of the last alarm


class Reputation:
    def __init__(self, path: str | os.PathLike | None, *, ban_threshold: float = -5.0,
                 ban_seconds: float = 3600.0, half_life_s: float = 3600.0,
                 spot_check_fraction: float = 1.0, new_peer_verdicts: int = 20,
                 trust_score: float = 5.0, suspect_seconds: float = 600.0,
                 max_peers: int = 100_000, save_interval_s: float = 5.0,
                 max_suspects: int = 4096, probation_accepts: int = 8,
                 alarm_forgive_s: float = ALARM_FORGIVE_S,
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
        self.max_suspects = max_suspects
        self.probation_accepts = probation_accepts
        self.alarm_forgive_s = alarm_forgive_s
        self.clock = clock
        self.peers: OrderedDict[str, PeerRecord] = OrderedDict()  # least recently used first
        self.suspects: OrderedDict[str, float] = OrderedDict()  # subject -> suspect until
        self.secret = secrets.token_bytes(16)
        self.hints = 0
        self._dirty: set[str] = set()
        self._journal_lines = 0
        self._last_save = 0.0
        self._load()

    @classmethod
    def from_config(cls, section, path: str | os.PathLike | None) -> Reputation:
        """Build from a `VerifierSection`."""
        return cls(path, ban_threshold=section.ban_threshold, ban_seconds=section.ban_seconds,
                   half_life_s=section.reputation_half_life_s,
                   spot_check_fraction=section.spot_check_fraction,
                   new_peer_verdicts=section.new_peer_verdicts,
                   trust_score=section.trust_score, suspect_seconds=section.hint_suspect_seconds,
                   alarm_forgive_s=section.alarm_forgive_s)

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
        self.peers.move_to_end(peer)
        weight = ACCEPT_WEIGHT if accepted else PENALTIES.get(reason, DEFAULT_PENALTY)
        rec.score = min(MAX_SCORE, self._decayed(rec, now) + weight)
        rec.updated = now
        rec.last_reason = reason
        if accepted:
            rec.accepted += 1
        else:
            rec.rejected += 1
        self._dirty.add(peer)
        if rec.score < self.ban_threshold and rec.banned_until <= now:
            rec.banned_until = now + self.ban_seconds
            log.warning("banned peer %s for %.0f s (score %.2f, last reason %s)",
                        peer, self.ban_seconds, rec.score, reason)
            self.save()
        else:
            self.maybe_save()
        return rec.score

    def record_alarm(self, peer: str, reason: str) -> float:
        """A per-peer test alarmed on `peer`: a peer without verified history is banned at
        once; an established one loses ALARM_PENALTY (banned when that takes it below the
        threshold). Returns the new score."""
        now = self.clock()
        established = self.established(peer)
        rec = self.peers.get(peer)
        if rec is None:
            self._make_room()
            rec = self.peers[peer] = PeerRecord(updated=now)
        self.peers.move_to_end(peer)
        rec.alarms = self._alarms(rec, now)  # what is left of the earlier ones
        rec.score = self._decayed(rec, now) + ALARM_PENALTY
        if not established:
            rec.score = min(rec.score, self.ban_threshold - 1.0)
        rec.updated, rec.last_reason = now, reason
        rec.rejected += 1
        rec.alarms += 1
        rec.alarm_at = now
        rec.accepted_at_alarm = rec.accepted  # probation again, longer (established)
        self._dirty.add(peer)
        if rec.score < self.ban_threshold and rec.banned_until <= now:
            rec.banned_until = now + self.ban_seconds
            log.warning("banned peer %s for %.0f s (%s alarm, score %.2f)", peer,
                        self.ban_seconds, reason, rec.score)
        else:
            log.warning("peer %s on probation again (%s alarm %d, score %.2f; needs %d "
                        "accepted completions)", peer, reason, rec.alarms, rec.score,
                        self.probation_needs(peer))
        self.save()
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
            self._dirty.add(peer)
            self.save()

    def established(self, peer: str) -> bool:
        """Out of probation: `probation_needs(peer)` accepted, model-checked rollouts since
        its last alarm and a positive score (verified history here; hints from others play
        no part). The verification queue serves established peers first (intake.py)."""
        rec = self.peers.get(peer)
        return (rec is not None
                and rec.accepted - rec.accepted_at_alarm >= self.probation_needs(peer)
                and self._decayed(rec, self.clock()) > 0)

    def _alarms(self, rec: PeerRecord, now: float) -> int:
        if rec.alarms <= 0 or self.alarm_forgive_s <= 0:
            return max(0, rec.alarms)
        forgiven = int(max(0.0, now - rec.alarm_at) // self.alarm_forgive_s)
        return max(0, rec.alarms - forgiven)

    def alarms(self, peer: str) -> int:
        """Alarms on `peer`'s record, less one per `alarm_forgive_s` since its last."""
        rec = self.peers.get(peer)
        return self._alarms(rec, self.clock()) if rec is not None else 0

    def probation_needs(self, peer: str) -> int:
        """Accepted completions since its last alarm that end `peer`'s probation:
        `probation_accepts`, times REPROBATION_FACTOR per alarm on record (capped)."""
        return self.probation_accepts * REPROBATION_FACTOR ** min(self.alarms(peer),
                                                                  REPROBATION_MAX_POWER)

    def reprobation(self, peer: str) -> bool:
        """On probation because of an alarm on record (not yet forgiven) and not yet out of
        it: the per-peer tests keep it at their head start (sequential.py `condemned`).
        Derived from the persisted record, so a restart or the tests' LRU forgets nothing."""
        rec = self.peers.get(peer)
        return (rec is not None and self.alarms(peer) > 0
                and rec.accepted - rec.accepted_at_alarm < self.probation_needs(peer))

    def _suspect(self, peer: str, now: float) -> bool:
        until = self.suspects.get(peer)
        return until is not None and until > now

    # spot checks -------------------------------------------------------------------------

    def check_fraction(self, peer: str) -> float:
        """Fraction of `peer`'s rollouts to verify: 1 for new, low-score or suspect peers."""
        rec = self.peers.get(peer)
        now = self.clock()
        if rec is None or rec.accepted + rec.rejected < self.new_peer_verdicts:
            return 1.0
        if self._suspect(peer, now) or self._decayed(rec, now) < self.trust_score:
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

    def should_verify_group(self, peer: str, rollout_ids: list[bytes]) -> bool:
        """Spot check of one task group: keyed hash over all its rollout ids (the sender
        cannot tell which of its groups will be checked)."""
        return self.should_verify(peer, b"".join(sorted(rollout_ids)))

    def hint(self, verdict, from_peer: str, trusted: bool = True) -> bool:
        """A `Verdict` published by another peer. A reject from a `trusted` peer (the caller
        decides: verified history here, or a followed trainer) makes the subject suspect:
        every rollout of it is verified, no spot checks, for `suspect_seconds`. Nothing else
        changes (score, ban, established). Returns whether it was used."""
        if (not trusted or verdict.accept or self.is_banned(from_peer)
                or verdict.subject == from_peer):
            return False
        self.hints += 1
        subject = verdict.subject
        self.suspects[subject] = max(self.suspects.get(subject, 0.0),
                                     self.clock() + self.suspect_seconds)
        self.suspects.move_to_end(subject)
        while len(self.suspects) > self.max_suspects:
            self.suspects.popitem(last=False)
        return True

    # persistence -------------------------------------------------------------------------

    def _make_room(self) -> None:
        """Forget least recently updated unbanned peers until one more fits (banned ones are
        moved to the back and kept while banned)."""
        now = self.clock()
        for _ in range(len(self.peers)):
            if len(self.peers) < self.max_peers:
                return
            peer, rec = next(iter(self.peers.items()))
            if rec.banned_until > now:
                self.peers.move_to_end(peer)
                continue
            del self.peers[peer]
            self._dirty.add(peer)  # journalled as a deletion

    def maybe_save(self) -> None:
        if self._dirty and self.clock() - self._last_save >= self.save_interval_s:
            self.save()

    @property
    def _journal(self) -> Path:
        return self.path.with_name(self.path.name + ".log")

    def save(self) -> None:
        """Append the changed records to the journal (no-op without a path); fold the
        journal into a new snapshot when it has grown long. A full disk is logged and the
        changes stay pending (retried at the next save): the node keeps running."""
        self._last_save = self.clock()
        if self.path is None:
            self._dirty.clear()
            return
        try:
            self._save()
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise
            log.warning("reputation not saved (disk full); %d changes kept in memory",
                        len(self._dirty))

    def _save(self) -> None:
        if not self.path.exists() or self._journal_lines > max(4096, 2 * len(self.peers)):
            self._snapshot()
            return
        if not self._dirty:
            return
        lines = [json.dumps({"peer": p, "record": asdict(self.peers[p]) if p in self.peers
                             else None}) + "\n" for p in sorted(self._dirty)]
        with open(self._journal, "a") as f:
            f.writelines(lines)
            f.flush()
            os.fsync(f.fileno())
        self._journal_lines += len(lines)
        self._dirty.clear()

    def _snapshot(self) -> None:
        state = {"version": STATE_VERSION, "secret": self.secret.hex(),
                 "peers": {p: asdict(r) for p, r in self.peers.items()}}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + f".tmp{os.getpid()}")
        with open(tmp, "w") as f:
            json.dump(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        self._journal.unlink(missing_ok=True)  # folded into the snapshot
        _fsync_dir(self.path.parent)
        self._journal_lines = 0
        self._dirty.clear()

    def _load(self) -> None:
        if self.path is None or not self.path.exists():
            return
        try:
            state = json.loads(self.path.read_text())
            if state.get("version") != STATE_VERSION:
                raise ValueError(f"state version {state.get('version')!r}")
            peers = {str(p): _record(r) for p, r in state["peers"].items()}
            secret = bytes.fromhex(state["secret"])
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            aside = self.path.with_name(self.path.name + ".corrupt")
            log.error("reputation file %s is unreadable (%s); moved to %s, starting fresh",
                      self.path, e, aside)
            os.replace(self.path, aside)
            self._journal.unlink(missing_ok=True)
            return
        self._journal_lines = self._replay_journal(peers)
        self.peers = OrderedDict(sorted(peers.items(), key=lambda kv: kv[1].updated))
        self.secret = secret

    def _replay_journal(self, peers: dict[str, PeerRecord]) -> int:
        if not self._journal.exists():
            return 0
        n = 0
        for line in self._journal.read_text().splitlines():
            try:
                entry = json.loads(line)
                peer, rec = str(entry["peer"]), entry["record"]
            except (ValueError, KeyError, TypeError):
                continue  # a torn last line after a crash
            n += 1
            if rec is None:
                peers.pop(peer, None)
            else:
                try:
                    peers[peer] = _record(rec)
                except (ValueError, TypeError, AttributeError):
                    continue
        return n


def _record(r: dict) -> PeerRecord:
    ints = ("accepted", "rejected", "alarms", "accepted_at_alarm")
    fields = {k: (str(v) if k == "last_reason" else int(v) if k in ints else float(v))
              for k, v in r.items() if k != "suspect_until"}
    if "alarm_at" not in fields:  # a record from before alarms were forgiven
        fields["alarm_at"] = fields.get("updated", 0.0)
    return PeerRecord(**fields)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass
