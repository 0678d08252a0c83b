"""Scenarios of issue #27 on the simulated internet, shared by tests/netlab and
benchmarks/wan.py. Each returns plain observations (a dict); the caller decides what must hold.

`pair`: a public trainer, a public relay, inference peers each behind its own home NAT (their
types given), 30-100 ms RTT and ~1% loss per path. Observed: when each NAT'd peer's rollouts
are first accepted (from its start), which policy versions each peer loaded, how every two
NAT'd peers are connected (direct after hole punching, relayed, or not at all), each peer's
reachability verdict, and log lines that show a peer could not be reached.
"""

from __future__ import annotations

import itertools
import random
import time
from dataclasses import dataclass
from pathlib import Path

from .errors import NetlabError
from .lab import Lab
from .swarm import LabSwarm, Launcher, accepted_from, log_signals
from .topology import Home, Host, Link, NatType, Topology

# one-way latency per leg; a path's RTT is 2 x the sum of its two legs: trainer-relay 30 ms,
# trainer-home1 40, trainer-home2 60, relay-home2 70, home1-home2 80, home3 (20 ms) 50-90.
# Loss 0.5% per leg: ~1% per path.
LEG_LOSS = 0.005
HOME_LINKS = (Link(latency_ms=15, loss=LEG_LOSS, up_mbit=20, down_mbit=100),
              Link(latency_ms=25, loss=LEG_LOSS, up_mbit=10, down_mbit=50),
              Link(latency_ms=20, loss=LEG_LOSS, up_mbit=30, down_mbit=100))


def pair_topology(*nats: NatType) -> Topology:
    """A public trainer and relay; inference peers peer1, peer2, ... each behind its own home
    NAT of the given type (default: two cone NATs)."""
    nats = nats or ("cone", "cone")
    if len(nats) > len(HOME_LINKS):
        raise NetlabError(f"the pair scenario has at most {len(HOME_LINKS)} NAT'd peers")
    return Topology(
        hosts=[Host("trainer", Link(latency_ms=5, loss=LEG_LOSS)),
               Host("relay", Link(latency_ms=10, loss=LEG_LOSS))],
        homes=[Home(f"home{i}", nat, HOME_LINKS[i - 1], [f"peer{i}"])
               for i, nat in enumerate(nats, 1)])


def link_kind(a: dict, b: dict) -> str:
    """How two nodes are connected, from their /status: "direct" (either side holds a
    direct connection to the other), "relayed" (only through a relay), or "none"."""
    kinds = []
    for me, other in ((a, b), (b, a)):
        pid = other.get("peer_id")
        if pid and pid in me.get("peers", []):
            relayed = (me.get("p2p") or {}).get("connections", {}).get("relayed_peers", [])
            kinds.append("relayed" if pid in relayed else "direct")
    if "direct" in kinds:
        return "direct"
    return "relayed" if kinds else "none"


def versions_loaded(status: dict) -> list[int]:
    """The policy versions a node downloaded (and so hot-loaded), from its /status; not the
    base model (v0). A version superseded while it downloaded is not among them."""
    return sorted({d.get("version") for d in status.get("downloads", [])
                   if isinstance(d.get("version"), int) and d["version"] > 0})


def expected_link(nat_a: str, nat_b: str) -> str:
    """What the NATs allow: hole punching (DCUtR) between two endpoint-independent (cone)
    NATs; a relay whenever one side is symmetric (a new public port per destination)."""
    return "direct" if (nat_a, nat_b) == ("cone", "cone") else "relayed"


def run_pair(lab: Lab, workdir: Path, model_dir: Path, versions: int = 2,
             timeout: float = 300.0, settings: dict | None = None,
             launch: Launcher | None = None) -> dict:
    """Start the trainer, the relay and every NAT'd peer of `lab` (a `pair_topology`) and
    watch until the trainer reached `versions`, every peer had rollouts accepted, hot-loaded
    `versions` versions and holds that version, and every two NAT'd peers were connected as
    their NATs allow (`expected_link`); or `timeout`. Never raises for a scenario goal
    missed: the observations say what happened. Times in s: `first_accepted_s` from each
    peer's own start, `goal_s` and `links_s` (when a pair was first seen connected as its
    NATs allow) from the trainer's start. `links` is the last snapshot and `link_history`
    every change seen per pair, (s, kind): relayed connections between NAT'd peers come
    and go on lossy paths (the peers redial), so a snapshot can catch a pair between two.
    `launch` starts the node processes (`LabSwarm`'s; default: exec'd)."""
    nats = {h.hosts[0]: h.nat for h in lab.topology.homes}
    obs: dict = {"topology": {"nat": nats}}
    with LabSwarm(lab, workdir, model_dir, settings=settings, launch=launch) as swarm:
        t0 = time.monotonic()
        trainer = swarm.start("trainer", "trainer", "trainer")
        swarm.wait_started(trainer)
        relay = swarm.start("relay", "relay", "relay", bootstrap=[trainer], follow=[trainer])
        t_peers = time.monotonic()
        peers = [swarm.start(name, name, "inference", bootstrap=[trainer], follow=[trainer])
                 for name in nats]
        swarm.wait_started(relay, *peers)
        obs["started_s"] = round(time.monotonic() - t0, 1)
        first_accepted: dict[str, float] = {}
        pairs = list(itertools.combinations(peers, 2))
        links_s: dict[str, float] = {}
        history: dict[str, list] = {f"{a.name}-{b.name}": [] for a, b in pairs}

        def goal() -> bool:
            now = time.monotonic()
            for p in peers:
                if accepted_from(trainer, p) and p.name not in first_accepted:
                    first_accepted[p.name] = round(now - t_peers, 1)
            for a, b in pairs:
                key = f"{a.name}-{b.name}"
                kind = link_kind(a.status, b.status)
                if not history[key] or history[key][-1][1] != kind:
                    history[key].append((round(now - t0, 1), kind))
                if key not in links_s and kind == expected_link(nats[a.name], nats[b.name]):
                    links_s[key] = round(now - t0, 1)
            return (trainer.status.get("policy_version", 0) >= versions
                    and len(first_accepted) == len(peers) and len(links_s) == len(pairs)
                    and all(p.status.get("policy_version", 0) >= versions
                            and len(versions_loaded(p.status)) >= versions for p in peers))

        try:
            swarm.wait_until(goal, timeout, "pair goal")
            obs["goal_s"] = round(time.monotonic() - t0, 1)
        except NetlabError as e:  # a missed goal is an observation, not an error
            obs["goal_s"] = None
            obs["missed"] = str(e).splitlines()[0]
        ids = {n.peer_id: n.name for n in swarm.nodes.values()}
        obs["trainer_version"] = trainer.status.get("policy_version", 0)
        obs["first_accepted_s"] = first_accepted
        obs["links_s"] = links_s
        obs["links"] = {f"{a.name}-{b.name}": link_kind(a.status, b.status) for a, b in pairs}
        obs["link_history"] = history  # ends with `links`: both come from the last poll
        for p in peers:
            by_trainer = trainer.status.get("accepted_by_peer", {}).get(p.peer_id, {})
            p2p = p.status.get("p2p") or {}
            obs[p.name] = {
                "nat": nats[p.name],
                "accepted": accepted_from(trainer, p),
                "rejected": by_trainer.get("rejected", 0),
                "reasons": by_trainer.get("reasons", {}),
                "rollouts_sent": p.status.get("rollouts_sent", 0),
                "policy_version": p.status.get("policy_version", 0),
                "versions_loaded": versions_loaded(p.status),
                "reachability": (p2p.get("reachability") or {}).get("verdict"),
                "relays_held": len((p2p.get("relay") or {}).get("reservations_held", [])),
                "hole_punch": (p2p.get("relay") or {}).get("hole_punch", {}),
            }
        obs["connected"] = {n.name: sorted(ids.get(x, x[-6:]) for x in n.status.get("peers", []))
                            for n in swarm.nodes.values()}
        obs["stage"] = lab.stage_stats()
        obs["exit_codes"] = swarm.stop_all()
        obs["log_signals"] = {n.name: log_signals(n) for n in swarm.nodes.values()}
    return obs


# `wan`: the full-size swarm ---------------------------------------------------------

@dataclass(frozen=True)
class WanPlan:
    """Who runs where in a `wan_plan` topology. `peers` are the inference hosts started at
    once; `spare` hosts stay idle until churn starts new peers on them."""

    topology: Topology
    trainer: str
    relays: tuple[str, ...]
    peers: tuple[str, ...]
    spare: tuple[str, ...]

    def nat_of(self, host: str) -> str:
        home = self.topology.home_of(host)
        return home.nat if home else "public"


def wan_plan(nodes: int, seed: int = 0, relays: int = 2, spare: int = 0,
             public_share: float = 1 / 3, symmetric_share: float = 0.5,
             trainer_mbit: float = 1000.0, leg_loss: float = LEG_LOSS) -> WanPlan:
    """`nodes` nodes: a public trainer (5 ms leg, `trainer_mbit` both ways), `relays` public
    relays (100-200 Mbit/s), and inference peers, `public_share` of them public (50-100 Mbit/s
    up), the rest each behind its own home NAT (`symmetric_share` symmetric, the rest cone;
    10-50 Mbit/s up, 50-200 down). Legs are 5-50 ms one way, so paths are 20-200 ms RTT;
    `leg_loss` per leg (~2x per path). `spare` more peer hosts for churn. Seeded."""
    rng = random.Random(seed)
    n_peers = nodes - 1 - relays
    if n_peers < 1:
        raise NetlabError(f"a wan plan of {nodes} nodes with {relays} relays has no peers")

    def leg() -> float:
        return round(rng.uniform(5.0, 50.0), 1)

    hosts = [Host("trainer", Link(latency_ms=5.0, loss=leg_loss, up_mbit=trainer_mbit,
                                  down_mbit=trainer_mbit))]
    hosts += [Host(f"relay{i}", Link(latency_ms=leg(), loss=leg_loss,
                                     up_mbit=rng.choice((100, 200)), down_mbit=200))
              for i in range(1, relays + 1)]
    homes, names = [], []
    total = n_peers + spare
    n_public = round(total * public_share)
    n_sym = round((total - n_public) * symmetric_share)
    for i in range(1, total + 1):
        name = f"p{i}"
        names.append(name)
        if i <= n_public:
            hosts.append(Host(name, Link(latency_ms=leg(), loss=leg_loss,
                                         up_mbit=rng.choice((50, 100)), down_mbit=200)))
            continue
        nat = "symmetric" if i <= n_public + n_sym else "cone"
        homes.append(Home(f"h{i}", nat, Link(latency_ms=leg(), loss=leg_loss,
                                             up_mbit=rng.choice((10, 20, 30, 50)),
                                             down_mbit=rng.choice((50, 100, 200))), [name]))
    # spare hosts are spread over the kinds too: take every k-th name as spare
    spare_names = names[::max(1, total // spare)][:spare] if spare else []
    peers = tuple(n for n in names if n not in spare_names)
    return WanPlan(Topology(hosts=hosts, homes=homes), "trainer",
                   tuple(f"relay{i}" for i in range(1, relays + 1)), peers, tuple(spare_names))
