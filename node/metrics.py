"""What a running node knows about itself: the source of GET /status and GET /metrics.

The roles update one `NodeState` (single event loop: no locks needed); the admin endpoint
renders it as JSON and the Prometheus exporter reads the same numbers.

Used by the roles (keep these names): `policy_id`, `policy_version`, `reward`,
`reward_history`, `rollouts_sent`, `accept(peer)`, `reject(peer, reason, n=1)`,
`count(name, n=1)`, `banned`, `versions_published`, `buffer_counters`,
`attach_transport(p2p)` (the P2PNode: connected peers, health, transport counters),
`metrics` (the one registry of every component's counters: `MetricsRegistry`),
`extra` (free-form role details),
`set_checkpoint_progress(...)`, `record_served(peer, nbytes)` (checkpoint bytes this node
uploaded to a peer: a relay's contribution), `set_problem(code, title, detail, fix)` /
`clear_problem(code)` (a stuck state the dashboard and `swarm-node status` show as a banner
naming its fix; the roles' usual ones are read from `extra` by node/dashboard/views.py).

History (`history()` / `restore()`, kept by the runner in `<data_dir>/history.json`): the
curves, downloads, per-peer counts, verdicts about this node and the event counters survive
a restart, bounded like the live state, so a restarted node's dashboard does not start
empty.

`metrics` is the one place every component's counters reach /metrics and /status: the
component that owns a counter registers it once, typed (`counters` or `gauges`, a family name,
its help text, the label of its keys and a reader called at scrape time: nothing is copied,
nothing probed). `registry` is this node's own Prometheus `CollectorRegistry` (never the
global one, so several nodes in one process do not collide); its collector renders the state
and every registered family at scrape time, so nothing is counted twice.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
)

MAX_TRACKED_PEERS = 4096
"""Peers counted individually; rollouts from further peers are counted under OTHER_PEERS."""
OTHER_PEERS = "(other)"
MAX_REASONS = 64
"""Distinct reject reasons exported as Prometheus labels; more are summed under `other`."""


log = logging.getLogger(__name__)

BUILTIN_FAMILIES = frozenset({
    "uptime_seconds", "connected_peers", "policy_version", "reward", "banned_peers",
    "rollouts_sent", "rollouts_accepted", "rollouts_rejected", "versions_published", "events",
    "buffer", "checkpoint_progress", "own_rollouts_accepted", "own_rollouts_rejected",
    "banned_by"})
"""Families the state renders itself (a component cannot register these names)."""

HISTORY = 500
"""Points kept for the dashboard's curves and download table."""
RATE_WINDOW_S = 3600.0
"""Rollouts per hour are counted over this window."""
MAX_RATE_EVENTS = 4096
DEFAULT_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
HISTOGRAMS = {
    "train_step_seconds": DEFAULT_BUCKETS,
    "verify_batch_seconds": DEFAULT_BUCKETS,
    "sample_round_seconds": DEFAULT_BUCKETS,
    "download_seconds": DEFAULT_BUCKETS,
    "checkpoint_load_seconds": DEFAULT_BUCKETS,
}
"""Histograms exported at /metrics as swarm_node_<name> (seconds unless named otherwise)."""


Read = Callable[[], Mapping[str, float]]


@dataclass(frozen=True)
class Family:
    """One registered metric family: `swarm_node_<name>` (counters: `..._total`), one sample
    per key of `read()`, labelled `label`. A `component` family is also in /status
    `components.<component>`."""

    name: str
    doc: str
    kind: Literal["counter", "gauge"]
    read: Read
    label: str = "name"
    component: str = ""


class MetricsRegistry:
    """Every component's counters and gauges, registered by the component's owner."""

    def __init__(self) -> None:
        self._families: dict[str, Family] = {}
        self._before_read: list[Callable[[], None]] = []

    def counters(self, name: str, doc: str, read: Read, *, label: str = "name",
                 component: str = "") -> None:
        """`swarm_node_<name>_total{<label>=key}` = read()[key]: counts that only grow."""
        self._add(Family(_metric_name(name), doc, "counter", read, label, component))

    def gauges(self, name: str, doc: str, read: Read, *, label: str = "name") -> None:
        """`swarm_node_<name>{<label>=key}` = read()[key]: values that go up and down."""
        self._add(Family(_metric_name(name), doc, "gauge", read, label))

    def _add(self, family: Family) -> None:
        if family.name in BUILTIN_FAMILIES:
            raise ValueError(f"metric family {family.name!r} is the node state's own")
        self._families[family.name] = family  # registered again (a restarted part): replaced

    def before_read(self, refresh: Callable[[], None]) -> None:
        """Call `refresh()` before every /status, /metrics and history read (e.g. to take a
        download's progress or a server's running totals): values are taken when asked for,
        not copied on a timer."""
        self._before_read.append(refresh)

    def refresh(self) -> None:
        for refresh in self._before_read:
            try:
                refresh()
            except Exception:  # a read never fails on a closing part
                log.debug("metrics refresh %r failed", refresh, exc_info=True)

    def families(self) -> list[Family]:
        return list(self._families.values())

    def components(self) -> dict[str, dict[str, float]]:
        return {f.component: dict(_read(f)) for f in self._families.values() if f.component}


def _read(family: Family) -> Mapping[str, float]:
    try:
        return family.read()
    except Exception:  # a scrape never fails on a closing part
        log.debug("metric family %s unreadable", family.name, exc_info=True)
        return {}


class Transport(Protocol):
    """What the state reads of the p2p host (node/p2p P2PNode): typed, never probed."""

    metrics: Any  # P2PMetrics: `.counters` {name: n}, gossip rejects as `rejected.<reason>`

    def connected_peers(self) -> list[str]: ...

    def health(self) -> dict[str, Any]: ...


class Histogram:
    """Cumulative-bucket histogram, rendered as a Prometheus histogram at scrape time."""

    def __init__(self, buckets=DEFAULT_BUCKETS):
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        value = float(value)
        i = next((i for i, b in enumerate(self.buckets) if value <= b), len(self.buckets))
        self.counts[i] += 1
        self.sum += value
        self.count += 1

    def cumulative(self) -> list[tuple[str, int]]:
        out, total = [], 0
        for bound, n in zip([*map(str, self.buckets), "+Inf"], self.counts):
            total += n
            out.append((bound, total))
        return out

    def summary(self) -> dict[str, float]:
        return {"count": self.count, "sum": round(self.sum, 6),
                "mean": round(self.sum / self.count, 6) if self.count else 0.0}


class OwnVerdicts:
    """What trainers said about this node's rollouts (signed verdicts on the verdicts topic,
    subject = this node): accepted counts, rejects by reason, bans, the latest few."""

    def __init__(self, keep: int = 50):
        self.accepted = 0
        self.rejected: Counter = Counter()
        self.by_trainer: dict[str, dict[str, Any]] = {}
        self.banned_by: dict[str, dict[str, Any]] = {}
        self.recent: deque = deque(maxlen=keep)
        # every trainer's batch summaries, whoever the subject: how many peers' rollouts it
        # accepted in all (this node's share of them is its contribution)
        self.trainer_accepted: Counter = Counter()
        self.accept_events: deque = deque(maxlen=MAX_RATE_EVENTS)  # (t, n) of my accepts
        self.first_seen = 0.0

    def swarm_summary(self, trainer: str, accepted: int) -> None:
        """A trainer's batch summary about any sender: `accepted` more peer rollouts."""
        if not self.first_seen:
            self.first_seen = time.time()
        if len(self.trainer_accepted) >= MAX_TRACKED_PEERS and \
                trainer not in self.trainer_accepted:
            trainer = OTHER_PEERS
        self.trainer_accepted[trainer] += accepted

    def add(self, trainer: str, accept: bool, reason: str, n: int, detail: str = "",
            version: int = 0) -> None:
        if len(self.by_trainer) >= MAX_TRACKED_PEERS and trainer not in self.by_trainer:
            trainer = OTHER_PEERS
        rec = self.by_trainer.setdefault(trainer, {"accepted": 0, "rejected": 0,
                                                   "reasons": Counter()})
        if accept:
            self.accepted += n
            rec["accepted"] += n
            self.accept_events.append((round(time.time(), 1), n))
        else:
            self.rejected[reason] += n
            rec["rejected"] += n
            rec["reasons"][reason] += n
        if reason == "banned" and not accept:
            self.banned_by[trainer] = {"since": round(time.time(), 1), "detail": detail}
        elif accept:
            self.banned_by.pop(trainer, None)
        self.recent.append({"t": round(time.time(), 1), "trainer": trainer, "accept": accept,
                            "reason": reason, "n": n, "version": version,
                            "detail": detail[:200]})

    def per_hour(self, now: float | None = None) -> dict[str, float]:
        """Rollouts of mine accepted in the last RATE_WINDOW_S, and the window they cover
        (shorter while this node has listened for less than the window)."""
        now = time.time() if now is None else now
        n = sum(k for t, k in self.accept_events if now - t <= RATE_WINDOW_S)
        start = self.first_seen or (self.accept_events[0][0] if self.accept_events else now)
        window = min(RATE_WINDOW_S, max(0.0, now - start))
        return {"accepted": n, "window_s": round(window, 1),
                "rate": round(n * 3600.0 / window, 1) if window >= 60 else None}

    def view(self) -> dict[str, Any]:
        return {"accepted": self.accepted, "rejected": dict(self.rejected),
                "by_trainer": {p: {**r, "reasons": dict(r["reasons"]),
                                   "trainer_accepted": self.trainer_accepted.get(p, 0)}
                               for p, r in self.by_trainer.items()},
                "banned_by": dict(self.banned_by), "recent": list(self.recent)[-20:],
                "per_hour": self.per_hour()}

    def history(self) -> dict[str, Any]:
        return {"accepted": self.accepted, "rejected": dict(self.rejected),
                "by_trainer": {p: {**r, "reasons": dict(r["reasons"])}
                               for p, r in self.by_trainer.items()},
                "banned_by": dict(self.banned_by), "recent": list(self.recent),
                "trainer_accepted": dict(self.trainer_accepted),
                "accept_events": list(self.accept_events), "first_seen": self.first_seen}

    def restore(self, doc: dict[str, Any]) -> None:
        self.accepted = int(doc.get("accepted", 0))
        self.rejected = Counter(_counts(doc.get("rejected")))
        for peer, rec in list(_dict(doc.get("by_trainer")).items())[:MAX_TRACKED_PEERS]:
            rec = _dict(rec)
            self.by_trainer[str(peer)] = {"accepted": int(rec.get("accepted", 0)),
                                          "rejected": int(rec.get("rejected", 0)),
                                          "reasons": Counter(_counts(rec.get("reasons")))}
        self.banned_by = {str(k): _dict(v) for k, v in _dict(doc.get("banned_by")).items()}
        self.recent.extend(r for r in doc.get("recent") or [] if isinstance(r, dict))
        self.trainer_accepted = Counter(_counts(doc.get("trainer_accepted")))
        self.accept_events.extend((float(t), int(n)) for t, n in doc.get("accept_events") or [])
        self.first_seen = float(doc.get("first_seen") or 0.0)


@dataclass
class PeerCounts:
    accepted: int = 0
    rejected: int = 0
    reasons: Counter = field(default_factory=Counter)


@dataclass
class NodeState:
    peer_id: str
    role: str
    swarm_id: str
    started: float = field(default_factory=time.time)
    p2p: Transport | None = None  # set by attach_transport
    phase: str = "starting"  # starting -> running (role started) -> stopping
    policy_id: str = ""
    policy_version: int = 0
    reward: float | None = None
    reward_history: list[tuple[int, float]] = field(default_factory=list)
    rollouts_sent: int = 0
    versions_published: int = 0
    banned: list[str] = field(default_factory=list)
    by_peer: dict[str, PeerCounts] = field(default_factory=dict)
    counters: Counter = field(default_factory=Counter)
    buffer_counters: dict[str, int] = field(default_factory=dict)
    checkpoint_progress: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    software_version: str = ""
    protocol_version: int = 0
    hardware: dict[str, Any] = field(default_factory=dict)
    own_verdicts: OwnVerdicts = field(default_factory=lambda: OwnVerdicts())
    histograms: dict[str, Histogram] = field(default_factory=dict)
    gauges: dict[str, float] = field(default_factory=dict)
    steps: deque = field(default_factory=lambda: deque(maxlen=HISTORY))
    downloads: deque = field(default_factory=lambda: deque(maxlen=HISTORY))
    metrics: MetricsRegistry = field(default_factory=MetricsRegistry)
    join_line: Any = None  # () -> the line others paste to join through this node
    problems: dict[str, dict[str, str]] = field(default_factory=dict)
    served: Counter = field(default_factory=Counter)  # checkpoint bytes uploaded, per peer
    _progress_start: tuple = (None, 0.0, 0)  # (version, t0, bytes at t0): download rate

    # updates ----------------------------------------------------------------------------

    def _peer(self, peer: str) -> PeerCounts:
        rec = self.by_peer.get(peer)
        if rec is None:
            if len(self.by_peer) >= MAX_TRACKED_PEERS:  # bounded, whatever peers claim
                peer = OTHER_PEERS
            rec = self.by_peer.setdefault(peer, PeerCounts())
        return rec

    def accept(self, peer: str, n: int = 1) -> None:
        self._peer(peer).accepted += n

    def reject(self, peer: str, reason: str, n: int = 1) -> None:
        rec = self._peer(peer)
        rec.rejected += n
        rec.reasons[reason] += n

    def count(self, name: str, n: int = 1) -> None:
        self.counters[name] += n

    def add_counters(self, component: str, read: Callable[[], Mapping[str, float]]) -> None:
        """A component's own counters (e.g. "broadcast"), read when /status or /metrics is
        rendered: `swarm_node_<component>_total{name=...}` at /metrics, and
        `components.<component>` in /status."""
        self.metrics.counters(component, f"Counters of the node's {component}, by name.",
                              read, component=component)

    def attach_transport(self, p2p: Transport) -> None:
        """The p2p host: its peers and health in /status, its counters at /metrics
        (`swarm_node_p2p_events_total{name}`, gossip rejects as
        `swarm_node_p2p_rejected_total{reason}`)."""
        self.p2p = p2p

        def counters(rejects: bool) -> dict[str, int]:
            return {k.removeprefix("rejected."): n for k, n in list(p2p.metrics.counters.items())
                    if k.startswith("rejected.") == rejects}
        self.metrics.counters("p2p_events", "Transport counters by name.",
                              lambda: counters(False))
        self.metrics.counters("p2p_rejected", "Gossip messages rejected, by reason code.",
                              lambda: counters(True), label="reason")

        def health(key: str) -> dict:
            try:
                return dict(p2p.health().get(key) or {})
            except Exception:  # noqa: BLE001 - a read never fails on a closing host
                return {}

        def reachability() -> dict[str, int]:
            verdict = health("reachability").get("verdict")
            return {v: int(v == verdict) for v in REACHABILITY} if verdict else {}

        def connections() -> dict[str, int]:
            conns = health("connections")
            return {k: conns[k] for k in ("open", "relayed", "target", "max") if k in conns}

        self.metrics.gauges("reachability", "1 on this node's reachability verdict (see "
                            "/status p2p.reachability).", reachability, label="verdict")
        self.metrics.gauges("p2p_connections", "Open libp2p connections (all, relayed) and "
                            "the bounds.", connections, label="kind")

    def observe(self, name: str, value: float) -> None:
        """One observation of a histogram in HISTOGRAMS (seconds, bytes, ...)."""
        hist = self.histograms.get(name)
        if hist is None:
            hist = self.histograms[name] = Histogram(HISTOGRAMS.get(name, DEFAULT_BUCKETS))
        hist.observe(value)

    def record_step(self, version: int, reward: float | None, **values: float) -> None:
        """One training step or sampling round for the dashboard's curves (bounded)."""
        point = {"t": round(time.time(), 1), "version": version, "reward": reward}
        point.update({k: v for k, v in values.items() if v is not None})
        self.steps.append(point)
        for key, value in values.items():
            if _is_number(value):
                self.gauges[key] = float(value)

    def record_download(self, version: int, policy_id: str, nbytes: int,
                        seconds: float | None, source: str = "") -> None:
        """One checkpoint downloaded and verified here (`seconds` None: not timed)."""
        self.downloads.append({"t": round(time.time(), 1), "version": version,
                               "policy_id": policy_id, "bytes": nbytes,
                               "seconds": None if seconds is None else round(seconds, 3),
                               "source": source})
        self.count("bytes_downloaded", nbytes)
        self.count("checkpoints_downloaded")
        if seconds is not None:
            self.observe("download_seconds", seconds)

    def set_checkpoint_progress(self, version: int, shards_done: int, shards_total: int,
                                bytes_done: int = 0, bytes_total: int = 0,
                                source: str = "") -> None:
        """Progress of the checkpoint being fetched (or served); shown by /status, with the
        rate since this version was first seen and the time left at that rate."""
        now = time.monotonic()
        if self._progress_start[0] != version:
            self._progress_start = (version, now, bytes_done)
        _, t0, b0 = self._progress_start
        complete = shards_total > 0 and shards_done >= shards_total
        rate = (bytes_done - b0) / (now - t0) if now - t0 >= 1.0 else None
        eta = None
        if complete:
            eta = 0.0
        elif rate:
            eta = round(max(0, bytes_total - bytes_done) / rate, 1)
        self.checkpoint_progress = {
            "version": version, "shards_done": shards_done, "shards_total": shards_total,
            "bytes_done": bytes_done, "bytes_total": bytes_total, "complete": complete,
            "rate_bytes_s": round(rate, 1) if rate is not None else None, "eta_s": eta,
            **({"source": source} if source else {}),
        }

    def set_problem(self, code: str, title: str, detail: str = "", fix: str = "",
                    level: str = "warning") -> None:
        """A stuck state shown as a banner until `clear_problem(code)`; `fix` says what the
        operator can do (level "error" or "warning")."""
        self.problems[code] = {"title": title, "detail": detail, "fix": fix, "level": level}

    def clear_problem(self, code: str) -> None:
        self.problems.pop(code, None)

    def record_served(self, peer: str, nbytes: int) -> None:
        """`nbytes` of checkpoint shards uploaded to `peer` (bounded per-peer table)."""
        if peer not in self.served and len(self.served) >= MAX_TRACKED_PEERS:
            peer = OTHER_PEERS
        self.served[peer] += nbytes

    @property
    def registry(self):
        """This node's Prometheus registry (created on first use)."""
        reg = self.__dict__.get("_registry")
        if reg is None:
            reg = CollectorRegistry(auto_describe=False)
            reg.register(_StateCollector(self))
            self.__dict__["_registry"] = reg
        return reg

    # views ------------------------------------------------------------------------------

    @property
    def join_command(self) -> str:
        """The complete `swarm-node join ...` line others paste to join through this node
        ("" until known)."""
        try:
            return self.join_line() if self.join_line is not None else ""
        except Exception:  # noqa: BLE001 - a status read never fails on a closing role
            return ""

    @property
    def rollouts_accepted(self) -> int:
        return sum(p.accepted for p in self.by_peer.values())

    @property
    def rejected_by_reason(self) -> dict[str, int]:
        total: Counter = Counter()
        for p in self.by_peer.values():
            total.update(p.reasons)
        return dict(total)

    def connected_peers(self) -> list[str]:
        if self.p2p is None:
            return []
        try:
            return list(self.p2p.connected_peers())
        except Exception:  # noqa: BLE001 - a status read never fails on a closing host
            return []

    def health(self) -> dict[str, Any] | None:
        if self.p2p is None:
            return None
        try:
            return self.p2p.health()
        except Exception:  # noqa: BLE001 - a status read never fails on a closing host
            return None

    def status(self) -> dict[str, Any]:
        """The JSON document served at GET /status."""
        self.metrics.refresh()
        return {
            "peer_id": self.peer_id,
            "role": self.role,
            "swarm_id": self.swarm_id,
            "phase": self.phase,
            "uptime_s": round(time.time() - self.started, 1),
            "p2p": self.health(),
            "connected_peers": len(peers := self.connected_peers()),
            "peers": peers,
            "policy_id": self.policy_id,
            "policy_version": self.policy_version,
            "reward": self.reward,
            "reward_history": self.reward_history[-200:],
            "rollouts_sent": self.rollouts_sent,
            "rollouts_accepted": self.rollouts_accepted,
            "rollouts_rejected": self.rejected_by_reason,
            "accepted_by_peer": {
                peer: {"accepted": c.accepted, "rejected": c.rejected,
                       "reasons": dict(c.reasons)}
                for peer, c in self.by_peer.items()
            },
            "banned": list(self.banned),
            "versions_published": self.versions_published,
            "checkpoint_progress": self.checkpoint_progress,
            "buffer": self.buffer_counters,
            "counters": dict(self.counters),
            "software_version": self.software_version,
            "protocol_version": self.protocol_version,
            "runtime": self.hardware,
            "verdicts_about_me": self.own_verdicts.view(),
            "steps": list(self.steps),
            "downloads": list(self.downloads),
            "histograms": {k: h.summary() for k, h in self.histograms.items()},
            "components": self.metrics.components(),
            "join_command": self.join_command,
            "problems": dict(self.problems),
            "served": {"bytes": sum(self.served.values()), "peers": len(self.served)},
            **({"extra": self.extra} if self.extra else {}),
        }

    # history across restarts ------------------------------------------------------------

    def history(self) -> dict[str, Any]:
        """What a restart keeps (see the module docstring); JSON-ready and bounded."""
        self.metrics.refresh()
        return {
            "version": 1, "saved": round(time.time(), 1),
            "steps": list(self.steps), "downloads": list(self.downloads),
            "reward_history": [list(p) for p in self.reward_history[-HISTORY:]],
            "rollouts_sent": self.rollouts_sent, "counters": dict(self.counters),
            "by_peer": {p: {"accepted": c.accepted, "rejected": c.rejected,
                            "reasons": dict(c.reasons)} for p, c in self.by_peer.items()},
            "own_verdicts": self.own_verdicts.history(), "served": dict(self.served),
        }

    def restore(self, doc: dict[str, Any]) -> None:
        """Take back what `history()` saved (a previous run's). Raises ValueError (or
        TypeError) on a document that is not one: the caller ignores it."""
        if not isinstance(doc, dict) or doc.get("version") != 1:
            raise ValueError("not a history document of this version")
        self.steps.extend(p for p in doc.get("steps") or [] if isinstance(p, dict))
        self.downloads.extend(d for d in doc.get("downloads") or [] if isinstance(d, dict))
        self.reward_history[:0] = [(int(v), float(r)) for v, r in
                                   (doc.get("reward_history") or [])[-HISTORY:]]
        self.rollouts_sent += int(doc.get("rollouts_sent", 0))
        self.counters.update(_counts(doc.get("counters")))
        for peer, rec in list(_dict(doc.get("by_peer")).items())[:MAX_TRACKED_PEERS]:
            rec = _dict(rec)
            mine = self._peer(str(peer))
            mine.accepted += int(rec.get("accepted", 0))
            mine.rejected += int(rec.get("rejected", 0))
            mine.reasons.update(_counts(rec.get("reasons")))
        self.own_verdicts.restore(_dict(doc.get("own_verdicts")))
        for peer, n in list(_counts(doc.get("served")).items())[:MAX_TRACKED_PEERS]:
            self.served[peer] += n
        if self.reward_history and self.reward is None:
            self.reward = self.reward_history[-1][1]


class _StateCollector:
    """Renders a NodeState as Prometheus metric families at scrape time."""

    def __init__(self, state: NodeState):
        self.state = state

    def collect(self):
        st = self.state
        st.metrics.refresh()

        def gauge(name, doc, value, labels=None):
            g = GaugeMetricFamily(f"swarm_node_{name}", doc, labels=list(labels or {}))
            g.add_metric(list((labels or {}).values()), float(value))
            return g

        yield InfoMetricFamily("swarm_node", "This node's identity.", value={
            "peer_id": st.peer_id, "role": st.role, "swarm_id": st.swarm_id})
        yield gauge("uptime_seconds", "Seconds since the node started.",
                    time.time() - st.started)
        yield gauge("connected_peers", "Open libp2p connections.", len(st.connected_peers()))
        yield gauge("policy_version", "Policy version this node samples or trains.",
                    st.policy_version)
        if st.reward is not None:
            yield gauge("reward", "Mean reward of the latest round or train step.", st.reward)
        yield gauge("banned_peers", "Peers currently banned.", len(st.banned))

        yield _counter("rollouts_sent", "Rollouts published.", st.rollouts_sent)
        yield _counter("rollouts_accepted", "Rollouts from peers accepted after verification.",
                       st.rollouts_accepted)
        yield _counter_by("rollouts_rejected", "Rollouts from peers rejected, by reason code.",
                          "reason", st.rejected_by_reason)
        yield _counter("versions_published", "Policy versions this trainer broadcast.",
                       st.versions_published)
        yield _counter_by("events", "Role events by name.", "event", st.counters)

        numbers = {k: v for k, v in st.buffer_counters.items() if _is_number(v)}
        if numbers:
            buf = GaugeMetricFamily("swarm_node_buffer", "Rollout buffer counters.",
                                    labels=["name"])
            for name, v in _capped(numbers).items():
                buf.add_metric([name], float(v))
            yield buf
        progress = {k: v for k, v in st.checkpoint_progress.items() if _is_number(v)}
        if progress:
            ck = GaugeMetricFamily("swarm_node_checkpoint_progress",
                                   "Checkpoint transfer progress.", labels=["field"])
            for name, v in progress.items():
                ck.add_metric([name], float(v))
            yield ck

        yield from _extra_families(st)
        for family in st.metrics.families():
            values = _capped({k: v for k, v in dict(_read(family)).items() if _is_number(v)})
            if family.kind == "counter":
                yield _counter_by(family.name, family.doc, family.label, values)
            else:
                g = GaugeMetricFamily(f"swarm_node_{family.name}", family.doc,
                                      labels=[family.label])
                for key, v in values.items():
                    g.add_metric([str(key)], float(v))
                yield g


REACHABILITY = ("unknown", "public", "relayed", "direct", "unreachable")


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _dict(value) -> dict:
    return value if isinstance(value, dict) else {}


def _counts(value) -> dict[str, int]:
    """{name: int} from a saved document, dropping what is not one."""
    return {str(k): int(v) for k, v in _dict(value).items()
            if _is_number(v) and len(str(k)) <= 128}


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    """The counter `swarm_node_<name>` with one unlabelled sample."""
    return CounterMetricFamily(f"swarm_node_{name}", doc, value=value)


def _counter_by(name: str, doc: str, label: str, values) -> CounterMetricFamily:
    """The counter `swarm_node_<name>`, one sample per key of `values` (capped)."""
    family = CounterMetricFamily(f"swarm_node_{name}", doc, labels=[label])
    for key, n in _capped(dict(values)).items():
        family.add_metric([key], n)
    return family


def _capped(values: dict[str, int | float]) -> dict[str, int | float]:
    """At most MAX_REASONS labels (the largest); the rest summed under `other`."""
    if len(values) <= MAX_REASONS:
        return values
    ranked = sorted(values.items(), key=lambda kv: kv[1], reverse=True)
    out = dict(ranked[:MAX_REASONS - 1])
    out["other"] = out.get("other", 0) + sum(v for _, v in ranked[MAX_REASONS - 1:])
    return out


def _extra_families(st: NodeState):
    """Histograms, training gauges and verdicts about this node."""
    for name, hist in st.histograms.items():
        h = HistogramMetricFamily(f"swarm_node_{name}", f"Histogram of {name}.")
        h.add_metric([], hist.cumulative(), hist.sum)
        yield h
    for name, value in _capped(dict(st.gauges)).items():
        yield GaugeMetricFamily(f"swarm_node_last_{_metric_name(name)}",
                                f"Latest {name} of a training step or sampling round.",
                                value=float(value))
    mine = st.own_verdicts
    yield _counter("own_rollouts_accepted",
                   "This node's rollouts that trainers reported accepted.", mine.accepted)
    yield _counter_by("own_rollouts_rejected",
                      "This node's rollouts that trainers reported rejected, by reason.",
                      "reason", mine.rejected)
    yield GaugeMetricFamily("swarm_node_banned_by", "Trainers that reported banning this node.",
                            value=len(mine.banned_by))


def _metric_name(name: str) -> str:
    return "".join(c if c.isalnum() or c == "_" else "_" for c in name)[:64]


# the history file -------------------------------------------------------------------------

HISTORY_FILE = "history.json"


def save_history(state: NodeState | dict, path: Path) -> None:
    """Write `state.history()` (or a document it returned) atomically to `path` (OSError to
    the caller). Take the document in the thread that updates the state."""
    doc = state if isinstance(state, dict) else state.history()
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, separators=(",", ":"), default=str))
    os.replace(tmp, path)


def load_history(state: NodeState, path: Path) -> str:
    """Restore a previous run's history from `path`; returns a note for the log ("" when
    there is none). A file that cannot be used is left aside, never fatal."""
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        return ""
    except (OSError, ValueError) as e:
        return f"history file {path} not used ({e})"
    try:
        state.restore(doc)
    except (TypeError, ValueError, AttributeError) as e:
        return f"history file {path} not used ({e})"
    return (f"history restored from {path}: {len(state.steps)} points, "
            f"{len(state.downloads)} downloads")
