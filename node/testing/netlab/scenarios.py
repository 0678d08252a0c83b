"""Scenarios of issue #27 on the simulated internet, shared by tests/netlab and
benchmarks/wan.py. Each returns plain observations (a dict); the caller decides what must hold.

`pair`: a public trainer, a public relay, two inference peers behind two home NATs (their
types given), 20-100 ms RTT and ~1% loss per path. Observed (times from the trainer's start):
whether and when each NAT'd peer's rollouts are accepted, which policy versions each peer
loaded, who is connected to whom, and log lines that show a peer could not be reached.
"""

from __future__ import annotations

import time
from pathlib import Path

from .errors import NetlabError
from .lab import Lab
from .swarm import LabSwarm, accepted_from, log_signals
from .topology import Home, Host, Link, NatType, Topology

# one-way latency per leg; a path's RTT is 2 x the sum of its two legs: trainer-relay 30 ms,
# trainer-home1 40, trainer-home2 60, relay-home2 70, home1-home2 80. Loss 0.5% per leg:
# ~1% per path.
LEG_LOSS = 0.005


def pair_topology(nat_a: NatType = "cone", nat_b: NatType = "cone") -> Topology:
    return Topology(
        hosts=[Host("trainer", Link(latency_ms=5, loss=LEG_LOSS)),
               Host("relay", Link(latency_ms=10, loss=LEG_LOSS))],
        homes=[Home("home1", nat_a, Link(latency_ms=15, loss=LEG_LOSS, up_mbit=20,
                                         down_mbit=100), ["peer1"]),
               Home("home2", nat_b, Link(latency_ms=25, loss=LEG_LOSS, up_mbit=10,
                                         down_mbit=50), ["peer2"])])


def run_pair(lab: Lab, workdir: Path, model_dir: Path, versions: int = 2,
             timeout: float = 300.0, settings: dict | None = None) -> dict:
    """Start the four nodes and watch until the trainer reached `versions` and both NAT'd
    peers had rollouts accepted and loaded that version, or `timeout`. Never raises for a
    scenario goal missed: the observations say what happened."""
    obs: dict = {"topology": {"nat": [h.nat for h in lab.topology.homes]}}
    with LabSwarm(lab, workdir, model_dir, settings=settings) as swarm:
        t0 = time.monotonic()
        trainer = swarm.start("trainer", "trainer", "trainer")
        swarm.wait_started(trainer)
        relay = swarm.start("relay", "relay", "relay", bootstrap=[trainer], follow=[trainer])
        peers = [swarm.start(f"peer{i}", f"peer{i}", "inference", bootstrap=[trainer],
                             follow=[trainer]) for i in (1, 2)]
        swarm.wait_started(relay, *peers)
        obs["started_s"] = round(time.monotonic() - t0, 1)
        first_accepted: dict[str, float] = {}
        versions_seen: dict[str, set[int]] = {p.name: set() for p in peers}

        def goal() -> bool:
            now = round(time.monotonic() - t0, 1)
            for p in peers:
                if accepted_from(trainer, p) and p.name not in first_accepted:
                    first_accepted[p.name] = now
                versions_seen[p.name].add(p.status.get("policy_version", 0))
            return (trainer.status.get("policy_version", 0) >= versions
                    and len(first_accepted) == len(peers)
                    and all(p.status.get("policy_version", 0) >= versions for p in peers))

        try:
            swarm.wait_until(goal, timeout, "pair goal")
            obs["goal_s"] = round(time.monotonic() - t0, 1)
        except NetlabError as e:  # a missed goal is an observation, not an error
            obs["goal_s"] = None
            obs["missed"] = str(e).splitlines()[0]
        ids = {n.peer_id: n.name for n in swarm.nodes.values()}
        obs["trainer_version"] = trainer.status.get("policy_version", 0)
        obs["first_accepted_s"] = first_accepted
        for p in peers:
            by_trainer = trainer.status.get("accepted_by_peer", {}).get(p.peer_id, {})
            obs[p.name] = {
                "accepted": accepted_from(trainer, p),
                "rejected": by_trainer.get("rejected", 0),
                "reasons": by_trainer.get("reasons", {}),
                "rollouts_sent": p.status.get("rollouts_sent", 0),
                "policy_version": p.status.get("policy_version", 0),
                "versions_seen": sorted(versions_seen[p.name]),
            }
        obs["connected"] = {n.name: sorted(ids.get(x, x[-6:]) for x in n.status.get("peers", []))
                            for n in swarm.nodes.values()}
        obs["stage"] = lab.stage_stats()
        obs["exit_codes"] = swarm.stop_all()
        obs["log_signals"] = {n.name: log_signals(n) for n in swarm.nodes.values()}
    return obs
