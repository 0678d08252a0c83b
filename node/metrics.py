"""What a running node knows about itself: the source of GET /status and GET /metrics.

The roles update one `NodeState` (single event loop: no locks needed); the admin endpoint
renders it as JSON and the Prometheus exporter reads the same numbers.

Used by the roles (keep these names): `policy_id`, `policy_version`, `reward`,
`reward_history`, `rollouts_sent`, `accept(peer)`, `reject(peer, reason, n=1)`,
`count(name, n=1)`, `banned`, `versions_published`, `buffer_counters`, `p2p` (the P2PNode,
for connected peers and transport counters), `extra` (free-form role details).
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any


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
    p2p: Any = None
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

    # updates ----------------------------------------------------------------------------

    def _peer(self, peer: str) -> PeerCounts:
        rec = self.by_peer.get(peer)
        if rec is None:
            rec = self.by_peer[peer] = PeerCounts()
        return rec

    def accept(self, peer: str, n: int = 1) -> None:
        self._peer(peer).accepted += n

    def reject(self, peer: str, reason: str, n: int = 1) -> None:
        rec = self._peer(peer)
        rec.rejected += n
        rec.reasons[reason] += n

    def count(self, name: str, n: int = 1) -> None:
        self.counters[name] += n

    # views ------------------------------------------------------------------------------

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

    def status(self) -> dict[str, Any]:
        """The JSON document served at GET /status."""
        return {
            "peer_id": self.peer_id,
            "role": self.role,
            "swarm_id": self.swarm_id,
            "uptime_s": round(time.time() - self.started, 1),
            "peers": self.connected_peers(),
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
            **({"extra": self.extra} if self.extra else {}),
        }
