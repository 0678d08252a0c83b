"""The simulated internet at full size (issue #27): real processes in network namespaces,
20-200 ms RTT, ~1% loss per path, home uplinks of 10-50 Mbit/s, NATs cone and symmetric.

    sudo .venv/bin/python benchmarks/wan.py                       # every section, 30 nodes
    sudo .venv/bin/python benchmarks/wan.py --sections stage pair --no-record
    sudo .venv/bin/python benchmarks/wan.py --sections swarm --nodes 8 --churn-minutes 1
    sudo .venv/bin/python benchmarks/wan.py --sections swarm --nodes 20 --launch-gap running

Sections (each writes its own part of RESULTS.md, "wan: <section>"):
- stage: what the lab itself sustains: the delay stage's packets/s and CPU per packet (UDP
  at rising rates), one bulk TCP flow through it, packets released late.
- pair: public trainer + relay, two inference peers behind two home NATs, for each NAT
  combination: when each NAT'd peer's rollouts are accepted, versions hot-loaded, whether the
  two NAT'd peers are connected, and what the logs say about unreachable peers.
- swarm: `--nodes` real `swarm-node join` nodes (netlab.scenarios.wan_plan: a public trainer,
  2 public relays, a third of the peers public, the rest each behind its own home NAT, half
  symmetric): time from each peer's start to its first accepted rollout (goal: 60 s), per-
  node connections, RSS, CPU (`--launch-gap S|running`: the boot peers one at a time, S s
  apart or each once the one before is 'running', instead of all at once; docs/wan-lab.md);
  then churn (every minute a fifth of the peers leave, half SIGKILL, half SIGTERM, and as
  many fresh ones join) and a partition that heals.
- gossip: `--nodes` gossip workers (our P2PNode, one per host, benchmarks/gossip.py's
  batches): rounds fully delivered and their p95, against the slowest path's RTT plus
  the batch's transfer time on the slowest uplink.
- broadcast: one `--mib` checkpoint from the trainer to every other node (broadcast_peer
  processes: 2 relays + followers), time until every copy is verified against the bandwidth
  lower bound max(S/u_origin, S/d_min, N S/(u_origin + sum u_i)), the trainer's egress in
  checkpoint sizes (bytes counted on its access link), and shardcast 0.3.2 in the same
  network (origin on the trainer, middles on the relays; needs .venv-shardcast, see
  benchmarks/broadcast.py).
- scaling: swarm (steady state only) and gossip at each of `--scaling` node counts.

Needs root (CI and these machines run as root). Memory: a `swarm-node join` process with the
tiny model holds a few hundred MiB (the swarm section prints each node's RSS): 24 GiB holds
~40-50 of them; gossip workers and broadcast peers are lighter. All traffic between sites
crosses one user-space delay stage (one core; the stage section says how much it carries).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import logging
import os
import queue
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Self

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from swarm_node.node.testing.netlab import Host, Lab, Link, NetlabError, Topology, probe
from swarm_node.node.testing.netlab.scenarios import (
    LEG_LOSS,
    WanPlan,
    link_kind,
    pair_topology,
    run_pair,
    wan_plan,
)
from swarm_node.node.testing.netlab.swarm import LabNode, LabSwarm, accepted_from, log_signals

from benchmarks.results import Headline, record, table

ROOT = Path(__file__).resolve().parents[1]
SHARDCAST_PY = ROOT / ".venv-shardcast" / "bin" / "python"
SHARDCAST_PEER = ROOT / "benchmarks" / "shardcast_peer.py"
PROBE = [sys.executable, probe.__file__]
MiB = 2**20
SECTIONS = ("stage", "pair", "swarm", "gossip", "broadcast", "scaling")


def load_avg() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


class LoadSampler:
    """The 1-min load average every `every` s while a section runs (the machine is shared:
    a figure is only as good as the load it was measured under)."""

    def __init__(self, every: float = 10.0):
        self.every, self.samples = every, [os.getloadavg()[0]]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self.samples.append(os.getloadavg()[0])

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.samples.append(os.getloadavg()[0])

    def summary(self) -> str:
        xs = self.samples
        return (f"min {min(xs):.1f} / mean {statistics.fmean(xs):.1f} / max {max(xs):.1f} "
                f"({len(xs)} samples)")


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q / 100 * (len(xs) - 1)))]


# Processes that speak JSON lines ----------------------------------------------------------

class LabProc:
    """A process in a lab host that prints one JSON object per line (events) and may read
    commands on stdin: gossip workers, broadcast peers, shardcast peers, probes."""

    def __init__(self, lab: Lab, host: str, argv: list[str], log: Path):
        self.host = host
        log.parent.mkdir(parents=True, exist_ok=True)
        self.log = log
        self._err = open(log, "w")  # noqa: SIM115 - closed in stop()
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        self.proc = lab.popen(host, argv, env=env, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=self._err, text=True)
        self.events: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("{"):
                try:
                    self.events.put(json.loads(line))
                except json.JSONDecodeError:
                    continue
        self.events.put({"event": "eof"})

    def event(self, kind: str, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            try:
                ev = self.events.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"{self.host}: no {kind!r} event in {timeout:.0f}s; "
                                   f"log: {self.tail()}") from None
            if ev.get("event") == kind or (kind == "any" and ev.get("event") != "eof"):
                return ev
            if ev.get("event") == "eof":
                raise RuntimeError(f"{self.host}: exited before {kind!r}; log: {self.tail()}")

    def send(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def tail(self, n: int = 1500) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send("quit")
                self.proc.stdin.close()
                self.proc.wait(15)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self._err.close()


# stage ------------------------------------------------------------------------------------

def section_stage(args, work: Path) -> tuple[str, dict]:
    topo = Topology(hosts=[Host("a", Link(latency_ms=5)), Host("b", Link(latency_ms=5))])
    rows, out = [], {"udp": [], "tcp": {}}
    with Lab(topo, prefix=args.lab_prefix) as lab:
        for rate in args.stage_rates:
            s0 = lab.stage_stats()
            n = int(rate * 2)
            sink = LabProc(lab, "b", [*PROBE, "udp-sink", "0", "1"], work / "stage" / "sink")
            port = sink.event("any", 30)["listening"]
            lab.run("a", [*PROBE, "udp-send", lab.addr("b"), str(port), str(n), str(rate)],
                    timeout=120, check=True)
            got = sink.event("any", 60)["received"]
            sink.stop()
            s1 = lab.stage_stats()
            pk = s1["packets"] - s0["packets"]
            cpu_us = (s1["cpu_s"] - s0["cpu_s"]) / max(pk, 1) * 1e6
            late = (s1["late_2ms"] - s0["late_2ms"]) / max(pk, 1)
            drops = s1["tun_drops"] - s0["tun_drops"]
            out["udp"].append({"rate": rate, "sent": n, "received": got, "cpu_us": cpu_us,
                               "late_2ms": late, "tun_drops": drops})
            rows.append([f"UDP {rate}/s", f"{got}/{n}", f"{cpu_us:.1f}", f"{late:.1%}", drops])
        s0 = lab.stage_stats()
        size = args.stage_tcp_mib * MiB
        sink = LabProc(lab, "b", [*PROBE, "sink", "0"], work / "stage" / "tcp")
        port = sink.event("any", 30)["listening"]
        lab.run("a", [*PROBE, "send", lab.addr("b"), str(port), str(size)], timeout=300,
                check=True)
        got = sink.event("any", 120)
        sink.stop()
        s1 = lab.stage_stats()
        reads = s1["reads"] - s0["reads"]
        mbit = got["after_first"] * 8 / got["span_s"] / 1e6
        out["tcp"] = {"mbit_s": mbit, "reads": reads, "bytes_per_read":
                      (s1["bytes"] - s0["bytes"]) / max(reads, 1),
                      "cpu_us": (s1["cpu_s"] - s0["cpu_s"]) / max(reads, 1) * 1e6}
        rows.append([(f"TCP bulk {args.stage_tcp_mib} MiB: {mbit:.0f} Mbit/s, "
                     f"{out['tcp']['bytes_per_read'] / 1024:.0f} KiB per GSO packet read"), "-",
                     f"{out['tcp']['cpu_us']:.1f} per GSO packet", "-",
                     s1["tun_drops"] - s0["tun_drops"]])
    lossy = []
    for loss in args.stage_losses:  # one TCP flow over 80 ms RTT, loss on one leg
        topo = Topology(hosts=[Host("a", Link(latency_ms=20, loss=loss)),
                               Host("b", Link(latency_ms=20))])
        with Lab(topo, prefix=args.lab_prefix) as lab:
            sink = LabProc(lab, "b", [*PROBE, "sink", "0"], work / "stage" / f"loss{loss}")
            port = sink.event("any", 30)["listening"]
            lab.run("a", [*PROBE, "send", lab.addr("b"), str(port), str(20 * MiB)],
                    timeout=600, check=True)
            got = sink.event("any", 120)
            sink.stop()
            st = lab.stage_stats()
        mbit = got["after_first"] * 8 / got["span_s"] / 1e6
        out.setdefault("tcp_loss", []).append({"loss": loss, "mbit_s": mbit, **st})
        lossy.append([f"{loss:.1%}", f"{mbit:.1f}", f"{st['lost']}/{st['packets']}",
                      st["split"]])
    body = (f"Load before: {args.load_before}. Two public hosts, 10 ms RTT, no loss, no "
            "shaping: everything crosses the delay stage (one Python process, one core).\n\n"
            + table(["traffic", "delivered", "stage CPU us/packet", "released >2 ms late",
                     "dropped before the stage"], rows)
            + "\n\nOne TCP flow (Linux default congestion control), 20 MiB over 80 ms RTT "
            "with random loss on the sender's leg (per wire segment, data and ACKs):\n\n"
            + table(["loss", "Mbit/s", "segments lost/seen", "GSO packets split"], lossy))
    return body, out


# pair -------------------------------------------------------------------------------------

def section_pair(args, work: Path, model_dir: Path) -> tuple[str, dict]:
    out = {}
    for nat_a, nat_b in args.pair_nats:
        with Lab(pair_topology(nat_a, nat_b), prefix=args.lab_prefix) as lab:
            obs = run_pair(lab, work / f"pair-{nat_a}-{nat_b}", model_dir,
                           versions=args.pair_versions, timeout=args.pair_timeout)
        out[f"{nat_a}/{nat_b}"] = obs
    return pair_body(args, out), out


def pair_body(args, out: dict) -> str:
    rows = []
    for key, obs in out.items():
        nat_a, nat_b = key.split("/")
        direct = obs["links"].get("peer1-peer2", "none")
        if obs.get("links_s", {}).get("peer1-peer2") is not None:
            direct += f" ({obs['links_s']['peer1-peer2']})"
        sig = {k: sum(s.get(k, 0) for s in obs["log_signals"].values())
               for k in ("payload_plane_unusable", "request_timed_out", "unretrieved_task_error")}
        rows.append([f"{nat_a} / {nat_b}", obs["started_s"], obs["goal_s"] or "missed",
                     " / ".join(str(obs["first_accepted_s"].get(p, "never"))
                                for p in ("peer1", "peer2")),
                     " / ".join(f"{obs[p]['accepted']} of {obs[p]['rollouts_sent']}"
                                for p in ("peer1", "peer2")),
                     " / ".join(str(obs[p]["policy_version"]) for p in ("peer1", "peer2")),
                     obs["trainer_version"], direct,
                     ", ".join(f"{k} {v}" for k, v in sig.items())])
    return (f"Load before: {args.load_before}. Trainer (5 ms leg), relay (10 ms), peer1 in "
            "home1 (15 ms, 20/100 Mbit/s), peer2 in home2 (25 ms, 10/50 Mbit/s); 0.5% loss "
            f"per leg. Goal: trainer at v{args.pair_versions}, both peers accepted and on "
            f"v{args.pair_versions}, and peer1-peer2 connected as the NATs allow (direct between "
            "two cone NATs, else relayed). Times in s: 'all started' and 'goal reached' from "
            "the trainer's start, 'first accepted' from the peer's own start (goal <= 60).\n\n"
            + table(["NAT peer1 / peer2", "all started", "goal reached", "first accepted",
                     "accepted of sent", "peer versions", "trainer version",
                     "peer1-peer2 link (first seen so, s)", "log lines (all nodes)"], rows))


# swarm (real nodes) -------------------------------------------------------------------------

def proc_usage(node: LabNode) -> dict:
    """RSS (MiB) and CPU seconds of a node's process tree."""
    import psutil

    try:
        root = psutil.Process(node.proc.pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return {"rss_mib": float("nan"), "cpu_s": float("nan")}
    rss = cpu = 0.0
    for p in procs:
        try:
            rss += p.memory_info().rss / MiB
            t = p.cpu_times()
            cpu += t.user + t.system
        except psutil.Error:
            pass
    return {"rss_mib": rss, "cpu_s": cpu}


def cpu_times():
    import psutil

    return psutil.cpu_times()


def busy_share(t0, t1) -> float:
    """The share of the machine's CPU time that was busy between two cpu_times()."""
    idle = (t1.idle + getattr(t1, "iowait", 0.0)) - (t0.idle + getattr(t0, "iowait", 0.0))
    total = sum(t1) - sum(t0)
    return round(1.0 - idle / total, 3) if total > 0 else float("nan")


LAUNCH_RUNNING_MAX_S = 180.0
"""`--launch-gap running`: the longest wait for a boot peer's 'running' before the next
launch (a peer that never gets there does not stop the others)."""
STEADY_POLL_S = 5.0
"""How often the steady window reads every node's /status (each pair's links over it)."""


class SwarmRun:
    """The real-node scenario on a wan_plan: start, contribute, steady state, churn,
    partition. Each phase adds to `self.out`."""

    def __init__(self, args, lab: Lab, plan: WanPlan, work: Path, model_dir: Path):
        self.args, self.lab, self.plan = args, lab, plan
        self.swarm = LabSwarm(lab, work, model_dir, settings=node_settings(args.node_set))
        self.started: dict[str, float] = {}  # node name -> monotonic start
        self.first_accepted: dict[str, float] = {}  # node name -> s after its start
        # node name -> s after its start when /status first said "running" (model loaded,
        # role started: on a loaded machine most of the wait to contribute is start-up)
        self.running_after: dict[str, float] = {}
        # node name -> its process tree's CPU s when /status first said running, and when its
        # first rollout was accepted: against the wall time, what was waiting for a core
        self.running_cpu: dict[str, float] = {}
        self.accepted_cpu: dict[str, float] = {}
        self.generation = 0
        self.joined: list[str] = []  # peers started by churn
        self.out: dict = {"nodes": len(plan.peers) + 1 + len(plan.relays)}

    def start_peer(self, host: str) -> LabNode:
        self.generation += 1
        name = f"{host}g{self.generation}"
        node = self.swarm.start(name, host, "inference",
                                bootstrap=[self.trainer, *self.relays], follow=[self.trainer])
        self.started[name] = time.monotonic()
        return node

    def peers(self) -> list[LabNode]:
        return [n for n in self.swarm.running() if n.role == "inference"]

    def track(self) -> None:
        now = time.monotonic()
        for n in self.peers():
            if n.name not in self.running_after and n.status.get("phase") == "running":
                self.running_after[n.name] = round(now - self.started[n.name], 1)
                self.running_cpu[n.name] = round(proc_usage(n)["cpu_s"], 1)
            if n.name not in self.first_accepted and accepted_from(self.trainer, n):
                self.first_accepted[n.name] = round(now - self.started[n.name], 1)
                self.accepted_cpu[n.name] = round(proc_usage(n)["cpu_s"], 1)

    def run(self, steady_only: bool = False) -> dict:
        try:
            self.boot()
            self.steady()
            if not steady_only and self.args.churn_minutes:
                self.churn()
            if not steady_only and self.args.partition_s:
                self.partition()
            self.finish()
        finally:
            self.out["exit_codes"] = self.swarm.stop_all()
            self.out["log_signals"] = {
                k: sum(log_signals(n).get(k, 0) for n in self.swarm.nodes.values())
                for k in ("payload_plane_unusable", "request_timed_out",
                          "unretrieved_task_error", "errors")}
        return self.out

    def boot(self) -> None:
        sw, plan = self.swarm, self.plan
        t0 = time.monotonic()
        self.trainer = sw.start("trainer", plan.trainer, "trainer")
        self.started["trainer"] = t0
        busy0 = cpu_times()
        sw.wait_started(self.trainer)
        self.relays = [sw.start(r, r, "relay", bootstrap=[self.trainer], follow=[self.trainer])
                       for r in plan.relays]
        sw.wait_started(*self.relays)
        peers: list[LabNode] = []
        self.out["launched_s"] = {}  # peer -> s after the trainer's launch
        for h in plan.peers:
            if peers:
                self.launch_gap(peers[-1])
            peers.append(self.start_peer(h))
            self.out["launched_s"][peers[-1].name] = round(time.monotonic() - t0, 1)
        sw.wait_started(*peers, timeout=120 + 10 * len(peers))
        self.out["all_started_s"] = round(time.monotonic() - t0, 1)

        def all_contributed():
            self.track()
            return all(n.name in self.first_accepted or n.exit_code is not None for n in peers)

        # a peer that exits is a figure (`exited`), not the end of the others' figures (a
        # host that died at 25 s once emptied a whole run's table); the trainer's or a
        # relay's exit still ends the wait
        deadline = time.monotonic() + self.args.contribute_timeout
        while True:
            exited = sum(n.exit_code is not None for n in peers)
            try:
                sw.wait_until(all_contributed, max(0.0, deadline - time.monotonic()),
                              "every peer accepted", every=2.0)
                break
            except Exception as e:  # noqa: BLE001 - a missed goal is a figure
                if (sum(n.exit_code is not None for n in peers) > exited
                        and time.monotonic() < deadline):
                    self.out.setdefault("exited", []).append(str(e).splitlines()[0])
                    continue
                self.out["contribute_missed"] = str(e).splitlines()[0]
                break
        by_nat: dict[str, list] = {}
        after_running: dict[str, list] = {}
        for n in peers:
            first = self.first_accepted.get(n.name)
            by_nat.setdefault(self.plan.nat_of(n.host), []).append(first)
            ran = self.running_after.get(n.name)
            after_running.setdefault(self.plan.nat_of(n.host), []).append(
                None if first is None or ran is None else round(max(0.0, first - ran), 1))
        self.out["first_accepted_s"] = by_nat
        self.out["accepted_after_running_s"] = after_running
        # how busy the machine's cores were from the trainer's start to here (the 2-core
        # machine's share of the start-up), and each boot peer's own CPU s at running / at
        # its first accepted rollout
        self.out["boot_busy"] = busy_share(busy0, cpu_times())
        self.out["boot_cpu_s"] = {n.name: [self.running_cpu.get(n.name),
                                           self.accepted_cpu.get(n.name)] for n in peers}

    def launch_gap(self, prev: LabNode) -> None:
        """Between two boot peers' launches (`--launch-gap`): nothing ('0', all at once), S
        seconds, or until `prev`'s /status says 'running' (at most LAUNCH_RUNNING_MAX_S, or
        it exited). Peers already up are tracked meanwhile (their first accepted rollout)."""
        gap, sw = self.args.launch_gap, self.swarm
        if gap in ("0", "0.0"):
            return
        t0 = time.monotonic()
        if gap == "running":
            limit = LAUNCH_RUNNING_MAX_S
            try:
                sw.wait_started(prev)
            except NetlabError:  # it died at start: launch the next
                return
        else:
            limit = float(gap)
        while time.monotonic() - t0 < limit:
            with contextlib.suppress(NetlabError):  # a peer exited: boot() reports it
                sw.poll()
            self.track()
            if gap == "running" and (prev.exit_code is not None
                                     or prev.status.get("phase") == "running"):
                return
            time.sleep(min(2.0, max(0.0, limit - (time.monotonic() - t0))))

    def steady(self) -> None:
        sw = self.swarm
        nodes = sw.running()
        u0 = {n.name: proc_usage(n) for n in nodes}
        t0, busy0 = time.monotonic(), cpu_times()
        v0 = self.trainer.status.get("policy_version", 0)
        # each inference pair's links over the window, polled (not only at its end): a pair
        # unconnected at the end may have been connected meanwhile
        seen: dict[tuple[str, str], set[str]] = {}
        while True:
            sw.poll()
            for a, b in itertools.combinations(self.peers(), 2):
                seen.setdefault((a.name, b.name), set()).add(link_kind(a.status, b.status))
            left = self.args.steady_s - (time.monotonic() - t0)
            if left <= 0:
                break
            time.sleep(min(STEADY_POLL_S, left))
        dt = time.monotonic() - t0
        usage = {}
        for n in nodes:
            u = proc_usage(n)
            kind = n.role if n.role != "inference" else self.plan.nat_of(n.host)
            usage.setdefault(kind, []).append({
                "connections": n.status.get("connected_peers", 0), "rss_mib": u["rss_mib"],
                "cpu_per_s": (u["cpu_s"] - u0[n.name]["cpu_s"]) / dt})
        self.out["steady"] = {"seconds": round(dt, 1), "usage": usage,
                              "busy": busy_share(busy0, cpu_times()),
                              "versions": self.trainer.status.get("policy_version", 0) - v0,
                              "connected_pairs": self.connected_pairs(),
                              "unconnected_pairs": unconnected_pairs(
                                  [(n.name, self.plan.nat_of(n.host), n.status)
                                   for n in self.peers()], seen),
                              "direct_lost": self.direct_lost(seen),
                              # per NAT'd peer: DCUtR's direct / failed / gave_up (for --json)
                              "hole_punch": {n.name: ((n.status.get("p2p") or {}).get("relay")
                                                      or {}).get("hole_punch")
                                             for n in self.peers()
                                             if self.plan.nat_of(n.host) != "public"},
                              "reachable": self.reachable()}

    def connected_pairs(self) -> dict:
        """Inference pairs of each NAT combination: [connected directly, through a relay,
        all pairs] (the connection manager keeps ~8 connections a node, so most pairs of a
        large swarm hold none: the share of direct among connected is the figure)."""
        peers = self.peers()
        out: dict[str, list[int]] = {}
        for a, b in itertools.combinations(peers, 2):
            kinds = "/".join(sorted((self.plan.nat_of(a.host), self.plan.nat_of(b.host))))
            kind = link_kind(a.status, b.status)
            cell = out.setdefault(kinds, [0, 0, 0])
            cell[0] += kind == "direct"
            cell[1] += kind == "relayed"
            cell[2] += 1
        return out

    def direct_lost(self, seen: dict[tuple[str, str], set[str]]) -> dict[str, int]:
        """Per NAT combination: pairs seen direct at some poll of the steady window and not
        direct at its end (a hole-punched connection that closed: relayed again, or none)."""
        out: dict[str, int] = {}
        for a, b in itertools.combinations(self.peers(), 2):
            if "direct" in seen.get((a.name, b.name), ()) and link_kind(
                    a.status, b.status) != "direct":
                kinds = "/".join(sorted((self.plan.nat_of(a.host), self.plan.nat_of(b.host))))
                out[kinds] = out.get(kinds, 0) + 1
        return out

    def reachable(self) -> dict:
        """Per NAT type: [peers others can reach (verdict public, relayed or direct), all]."""
        out: dict[str, list[int]] = {}
        for n in self.peers():
            verdict = ((n.status.get("p2p") or {}).get("reachability") or {}).get("verdict")
            cell = out.setdefault(self.plan.nat_of(n.host), [0, 0])
            cell[0] += verdict in ("public", "relayed", "direct")
            cell[1] += 1
        return out

    def churn(self) -> None:
        sw, rng = self.swarm, random.Random(self.args.seed)
        free = list(self.plan.spare)
        minutes = []
        for minute in range(self.args.churn_minutes):
            t0, w0 = time.monotonic(), time.time()
            v0 = self.trainer.status.get("policy_version", 0)
            peers = self.peers()
            k = max(1, len(peers) // 5)
            leaving = rng.sample(peers, k)
            for i, n in enumerate(leaving):
                sw.stop(n, kill=i % 2 == 0)
            joined = [self.start_peer(free.pop(0)) for _ in range(min(k, len(free)))]
            sw.wait_started(*joined)  # node.json: its peer id and admin port (its /status)
            free += [n.host for n in leaving]
            while time.monotonic() - t0 < 60:
                time.sleep(2.0)
                sw.poll()
                self.track()
            # stopping and starting can take longer than the minute on a loaded machine:
            # the figures below must not come from statuses read before it
            sw.poll()
            self.track()
            downloads = [d["seconds"] for n in self.peers() for d in n.status.get("downloads", [])
                         if d.get("t", 0) >= w0 and d.get("seconds") is not None]
            self.joined += [n.name for n in joined]
            minutes.append({"minute": minute + 1, "seconds": round(time.monotonic() - t0, 1),
                            "left": k, "joined": len(joined), "at": round(w0, 1),
                            # who left (SIGKILL or SIGTERM) and joined: the node logs' closes
                            "left_nodes": {n.name: "kill" if i % 2 == 0 else "term"
                                           for i, n in enumerate(leaving)},
                            "joined_nodes": [n.name for n in joined],
                            "trainer_versions": self.trainer.status.get("policy_version", 0) - v0,
                            "joined_contributing": sum(n.name in self.first_accepted
                                                       for n in joined),
                            "download_p95_s": pct(downloads, 95), "downloads": len(downloads)})
        self.out["churn"] = minutes

    def partition(self) -> None:
        sw = self.swarm
        peers = self.peers()
        half_a = [self.trainer.host, self.relays[0].host, *[n.host for n in peers[::2]]]
        half_b = [r.host for r in self.relays[1:]] + [n.host for n in peers[1::2]]
        sent0 = {n.name: n.status.get("rollouts_sent", 0) for n in peers}
        v0 = self.trainer.status.get("policy_version", 0)
        self.lab.partition(half_a, half_b)
        at = time.time()
        time.sleep(self.args.partition_s)
        sw.poll()
        side = {n.name: ("a" if n.host in half_a else "b") for n in peers}
        sent = {s: sum(n.status.get("rollouts_sent", 0) - sent0[n.name] for n in peers
                       if side[n.name] == s) for s in ("a", "b")}
        v_heal = self.trainer.status.get("policy_version", 0)
        self.lab.heal()
        healed_at = time.time()
        t0 = time.monotonic()
        tid = self.trainer.peer_id

        def converged():
            return all(n.status.get("policy_id") == tid
                       and n.status.get("policy_version", 0) >= v_heal for n in self.peers())

        try:
            converge = round(sw.wait_until(converged, self.args.converge_timeout,
                                           "one lineage after the heal", every=2.0), 1)
        except Exception:  # noqa: BLE001 - not converging is a figure
            converge = None
        self.out["partition"] = {"seconds": self.args.partition_s,
                                 "trainer_versions_during": v_heal - v0,
                                 "rollouts_sent_during": sent,
                                 "converged_after_heal_s": converge,
                                 "since_heal_s": round(time.monotonic() - t0, 1),
                                 # wall clock, for the node logs (closes across the halves)
                                 "at": round(at, 1), "healed_at": round(healed_at, 1),
                                 "sides": side}

    def finish(self) -> None:
        self.swarm.poll()
        self.track()
        # churn's newcomers: s from launch to first accepted (None: not yet, or it left)
        self.out["joined_first_accepted_s"] = [self.first_accepted.get(n) for n in self.joined]
        self.out["nat_of"] = {n.name: self.plan.nat_of(n.host)  # every peer run, left too
                              for n in self.swarm.nodes.values() if n.role == "inference"}
        hist = self.trainer.status.get("reward_history", [])
        rewards = [r for _, r in hist]
        versions = [v for v, _ in hist]
        # a round lost: a version the trainer skipped (no step recorded for it)
        lost = (versions[-1] - versions[0] + 1 - len(set(versions))) if versions else 0
        self.out["trainer"] = {
            "version": self.trainer.status.get("policy_version", 0),
            "reward_first3": statistics.fmean(rewards[:3]) if rewards else None,
            "reward_last3": statistics.fmean(rewards[-3:]) if rewards else None,
            "versions_recorded": len(hist), "rounds_lost": lost,
            "rollouts_accepted": self.trainer.status.get("rollouts_accepted", 0),
            # the intake's queues and probation budget (verifier/intake.py), for the --json
            "buffer": self.trainer.status.get("buffer"),
            "counters": self.trainer.status.get("counters")}
        self.out["stage"] = self.lab.stage_stats()


def unconnected_pairs(peers: list[tuple[str, str, dict]],
                      seen: dict[tuple[str, str], set[str]]) -> dict:
    """Inference pairs (`peers`: name, NAT type, /status) not connected now, per NAT
    combination, by why: `full` (both sides hold `p2p.target_peers` connections or more:
    discovery dials only below it, so neither picked the other; by design) or `short` (a
    side below it: a connection lost or a dial failed and not replaced yet; look at the
    node logs), and how many of them
    `seen` (pair -> link kinds polled over the window) had connected earlier (`was`).
    `detail` names each pair: per side its open connections and how it saw the other
    (`side_view`)."""
    out: dict = {}
    for (a, nat_a, st_a), (b, nat_b, st_b) in itertools.combinations(peers, 2):
        if link_kind(st_a, st_b) != "none":
            continue
        sides = [side_view(st_a, st_b.get("peer_id")), side_view(st_b, st_a.get("peer_id"))]
        full = all(s["open"] >= s["target"] for s in sides)
        was = sorted(seen.get((a, b), set()) - {"none"})
        cell = out.setdefault("/".join(sorted((nat_a, nat_b))),
                              {"full": 0, "short": 0, "was": 0, "detail": []})
        cell["full" if full else "short"] += 1
        cell["was"] += bool(was)
        cell["detail"].append({"pair": [a, b], "sides": sides, "was": was})
    return out


def side_view(status: dict, other: str | None) -> dict:
    """One side of an unconnected pair, from its /status: its open connections and target,
    and how it saw the other (`p2p.peer_reach`; None: not among the peers it knows)."""
    p2p = status.get("p2p") or {}
    conns = p2p.get("connections") or {}
    return {"open": conns.get("open", status.get("connected_peers", 0)),
            "target": conns.get("target", 8),
            "knows": (p2p.get("peer_reach") or {}).get(other)}


def node_settings(pairs: list[str]) -> dict:
    """`--node-set section.key=value` (JSON value, else the string) as config sections."""
    out: dict[str, dict] = {}
    for kv in pairs:
        key, _, value = kv.partition("=")
        section, _, name = key.partition(".")
        try:
            out.setdefault(section, {})[name] = json.loads(value)
        except json.JSONDecodeError:
            out.setdefault(section, {})[name] = value
    return out


def swarm_figures(args, n: int, work: Path, model_dir: Path, steady_only: bool) -> dict:
    plan = wan_plan(n, seed=args.seed, spare=0 if steady_only else max(1, (n - 3) // 5),
                    trainer_mbit=args.trainer_mbit)
    with Lab(plan.topology, prefix=args.lab_prefix, seed=args.seed) as lab:
        return SwarmRun(args, lab, plan, work / f"swarm{n}", model_dir).run(steady_only)


def usage_rows(out: dict) -> list[list]:
    rows = []
    for kind, items in sorted(out["steady"]["usage"].items()):
        rows.append([kind, len(items), statistics.fmean(i["connections"] for i in items),
                     statistics.fmean(i["rss_mib"] for i in items),
                     statistics.fmean(i["cpu_per_s"] for i in items)])
    return rows


def section_swarm(args, work: Path, model_dir: Path) -> tuple[str, dict]:
    out = swarm_figures(args, args.nodes, work, model_dir, steady_only=False)
    return swarm_body(args, out), out


def swarm_body(args, out: dict) -> str:
    after = out.get("accepted_after_running_s", {})
    contrib = []
    for k, v in sorted(out["first_accepted_s"].items()):
        ok = [x for x in v if x is not None]
        ran = [x for x in after.get(k, []) if x is not None]
        contrib.append([k, len(v), len(ok), sum(x <= 60 for x in ok), pct(ok, 50),
                        max(ok, default=float("nan")), pct(ran, 50),
                        max(ran, default=float("nan"))])
    cpu = [v for v in out.get("boot_cpu_s", {}).values() if v[0] is not None]
    launched = list(out.get("launched_s", {}).values())
    lines = [(f"Load before: {args.load_before}. {out['nodes']} nodes (wan_plan seed "
             f"{args.seed}). {launch_line(args, launched)} All started after "
             f"{out.get('all_started_s')} s. The cores were "
             f"{out.get('boot_busy', float('nan')):.0%} busy from the trainer's start to the "
             f"end of the contribute wait; a boot peer's own CPU until 'running': p50 "
             f"{pct([c[0] for c in cpu], 50)} s of CPU."),
             "", ("Time from a peer's start (process launched) to its first accepted rollout "
                  "(goal <= 60 s), and from its /status first saying 'running' (model loaded, "
                  "role started; polled every 2 s) to that rollout:"), "",
             table(["peers", "n", "contributed", "within 60 s", "p50 s", "max s",
                    "from running p50 s", "from running max s"], contrib), "",
             *([f"Peers that exited during the start: {out['exited']}", ""]
               if out.get("exited") else []),
             (f"Steady state ({out['steady']['seconds']} s, trainer +"
             f"{out['steady']['versions']} versions; the machine's cores "
             f"{out['steady'].get('busy', float('nan')):.0%} busy), mean per node:"), "",
             table(["kind", "n", "connections", "RSS MiB", "CPU s/s"], usage_rows(out)), "",
             "Reachable by any peer (verdict public, relayed or direct; goal 100% for every NAT "
             "type): " + ", ".join(f"{k} {c}/{t}" for k, (c, t) in sorted(
                 out["steady"]["reachable"].items())),
             "Inference pairs connected, direct / relayed / pairs (goal: >= 95% of connected "
             "cone/cone pairs direct): " + ", ".join(
                 f"{k} {d}/{r}/{t}" for k, (d, r, t) in sorted(
                     out["steady"]["connected_pairs"].items())),
             unconnected_line(out["steady"].get("unconnected_pairs", {})),
             "Pairs direct at some poll of the window (every 5 s) and not at its end: " + (
                 ", ".join(f"{k} {n}" for k, n in sorted(out["steady"]["direct_lost"].items()))
                 if out["steady"].get("direct_lost") else "none")]
    if "churn" in out:
        lines += ["", "Churn (every minute a fifth leave, half SIGKILL, and as many join):", "",
                  table(["minute", "s", "left", "joined", "joined contributing",
                         "trainer +versions", "downloads", "download p95 s"],
                        [[m["minute"], m.get("seconds", "-"), m["left"], m["joined"],
                          m["joined_contributing"],
                          m["trainer_versions"], m["downloads"], m["download_p95_s"]]
                         for m in out["churn"]]), "",
                  ("Newcomers' first accepted rollout, s from launch (None: not by the end, or "
                  f"left first): {out.get('joined_first_accepted_s', 'not recorded')}")]
    if "partition" in out:
        p = out["partition"]
        lines += ["", (f"Partition for {p['seconds']} s (trainer + relay1 + half the peers | "
                  f"relay2 + the other half): trainer +{p['trainer_versions_during']} versions; "
                  f"rollouts sent during it: {p['rollouts_sent_during']}; after the heal every "
                  f"peer on the trainer's lineage in {p['converged_after_heal_s']} s.")]
    t = out["trainer"]
    r3 = [f"{x:.3f}" if isinstance(x, float) else x for x in (t["reward_first3"],
                                                              t["reward_last3"])]
    lines += ["", (f"Trainer: v{t['version']}, reward first 3 versions {r3[0]}, "
              f"last 3 {r3[1]}; versions skipped (rounds lost) {t['rounds_lost']}; "
              f"rollouts accepted {t['rollouts_accepted']}. Log "
              f"lines: {out['log_signals']}. Delay stage: {out['stage']}.")]
    return "\n".join(lines)


def unconnected_line(pairs: dict) -> str:
    """The pairs not connected at the end of the steady window, by why (`unconnected_pairs`)."""
    if not pairs:
        return "Every inference pair connected at the end of the steady window."
    return ("Pairs not connected at its end, per combination: full (both sides at "
            "p2p.target_peers connections or more: discovery dials only below it; by design) / "
            "short (a side below it: a connection lost or a dial failed, not replaced by then) / of "
            "them connected earlier in the window: "
            + ", ".join(f"{k} {c['full']}/{c['short']}/{c['was']}"
                        for k, c in sorted(pairs.items())) + ".")


def launch_line(args, launched: list[float]) -> str:
    """What `--launch-gap` did, in the section's words."""
    span = (f" (launched {min(launched):.1f}-{max(launched):.1f} s after the trainer)"
            if launched else "")
    if args.launch_gap in ("0", "0.0"):
        return (f"Launch: the trainer, then the 2 relays once they listen, then every "
                f"inference peer at once{span}.")
    how = ("as soon as the one before it said 'running' in its /status (model loaded, role "
           f"started; polled every 2 s, at most {LAUNCH_RUNNING_MAX_S:.0f} s)"
           if args.launch_gap == "running" else f"{float(args.launch_gap):g} s after the one "
           "before it")
    return (f"Launch (`--launch-gap {args.launch_gap}`): the trainer, the relays, then one "
            f"inference peer at a time, each {how}{span}, so a peer boots beside a running "
            "swarm rather than beside all the others booting; every time below counts from "
            "that peer's own launch.")


# start-up timeline (node logs) -------------------------------------------------------------

# a peer's start-up stages, by the first log line that says each (node/runner.py, roles)
TIMELINE = (("imports", None), ("host", "admin endpoint on"), ("verdict", "reachability: "),
            ("relay slot", "reserved a relay slot"), ("ready", "peer ready"),
            ("published", "published round"), ("accepted", "verified my round"))


def peer_timeline(node_dir: Path) -> dict[str, float]:
    """s from a peer's launch (its node.toml written just before) to the first log line of
    each TIMELINE stage; 'accepted' is the first verdict with at least one accepted."""
    t0 = (node_dir / "node.toml").stat().st_mtime
    got: dict[str, float] = {}
    for line in (node_dir / "node.log").read_text(errors="replace").splitlines():
        if not line[:4].isdigit():
            continue
        for stage, needle in TIMELINE:
            if stage in got or (needle is not None and needle not in line):
                continue
            if stage == "accepted" and ": 0 accepted" in line:
                continue
            # the logging format's asctime: local time, as mktime reads it
            at = time.mktime(time.strptime(line[:19], "%Y-%m-%d %H:%M:%S"))
            got[stage] = round(at + float(line[19:23]) - t0, 1)
    return got


def timeline_table(work: Path) -> str:
    """Per peer of a swarm run's workdir (node logs), s from launch to each stage."""
    rows = []
    for d in sorted(work.iterdir()):
        if (d / "node.log").exists() and (d / "node.toml").exists() and d.name.startswith("p"):
            got = peer_timeline(d)
            rows.append([d.name, *(got.get(stage, "-") for stage, _ in TIMELINE)])
    return table(["peer", *(stage for stage, _ in TIMELINE)], rows)


# gossip (P2PNode workers) -------------------------------------------------------------------

def gossip_worker(args) -> None:
    """One gossip peer (in a lab host): our P2PNode, one batch per round, arrivals recorded.
    Prints ready / meshed / done; reads {"start": t} and a final line on stdin."""
    import asyncio

    asyncio.run(_gossip_worker(args))


async def install_hop_probes(node) -> dict:
    """Benchmark probes on the libp2p (trio) side of one gossip worker, for a per-hop split
    of each announce's trip: per pubsub message (key "origin/seqno"), when its first copy's
    RPC was read and by whom it came (`read`), when its push_msg task started (`task`),
    its validation's start and end (`valid`, the first copy only: later ones are dropped
    as seen), and every write of an RPC carrying it to a peer (`writes`: peer, start, end;
    our own and the ones we forward); our publishes (`published`: trio start, end, seqno)
    and the trio loop's lag (`trio_lag`: how late a LAG_PROBE_S sleep wakes)."""
    import trio
    from swarm_node.node.p2p.gossip import origin_b58

    ctx = node.context
    pubsub, validator = ctx.pubsub, node.gossip.validator
    now = time.time
    p: dict = {"read": {}, "task": {}, "valid": {}, "writes": {}, "published": [],
               "trio_lag": []}

    def key(msg) -> str:
        return f"{origin_b58(msg.from_id)}/{int.from_bytes(msg.seqno, 'big')}"

    async def install() -> None:
        me = pubsub.my_id
        mgr = pubsub.manager
        run_task = mgr.run_task

        def timed_run_task(fn, *args, **kw):
            if len(args) == 2 and hasattr(args[1], "seqno"):  # push_msg(forwarder, msg)
                p["read"].setdefault(key(args[1]), (now(), args[0].to_base58()))
            return run_task(fn, *args, **kw)

        mgr.run_task = timed_run_task
        push_msg = pubsub.push_msg

        async def timed_push_msg(fwd, msg):
            if fwd != me:
                p["task"].setdefault(key(msg), now())
            await push_msg(fwd, msg)

        pubsub.push_msg = timed_push_msg
        validate = validator.validate

        def timed_validate(allowed, fwd, msg, kind=""):
            t0 = now()
            ok = validate(allowed, fwd, msg, kind)
            if msg.from_id != me.to_bytes():
                env = validator.accepted.get(msg.from_id + msg.seqno)
                p["valid"].setdefault(key(msg), (t0, now(), fwd.to_base58(), ok,
                                                 env.ts_ms if env is not None else 0))
            return ok

        validator.validate = timed_validate
        write_msg = pubsub.write_msg

        async def timed_write_msg(stream, rpc):
            if not rpc.publish:
                return await write_msg(stream, rpc)
            t0 = now()
            ok = await write_msg(stream, rpc)
            t1 = now()
            peer = stream.muxed_conn.peer_id.to_base58()
            for m in rpc.publish:
                p["writes"].setdefault(key(m), []).append((peer, t0, t1))
            return ok

        pubsub.write_msg = timed_write_msg
        t_publish = node.gossip._t_publish

        async def timed_t_publish(t, data):
            t0 = now()
            await t_publish(t, data)
            p["published"].append((t0, now(), pubsub.counter))

        node.gossip._t_publish = timed_t_publish

        async def lag() -> None:
            while True:
                t0 = trio.current_time()
                await trio.sleep(LAG_PROBE_S)
                p["trio_lag"].append(trio.current_time() - t0 - LAG_PROBE_S)

        ctx.nursery.start_soon(lag)

    await ctx.bridge.call(install)
    return p


async def _gossip_worker(args) -> None:
    import asyncio

    from swarm_node.node.config import load_config
    from swarm_node.node.identity import Identity
    from swarm_node.node.p2p import P2PNode

    from benchmarks.gossip import make_batch

    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    over = {"node.swarm_id": "bench", "node.listen": [args.listen]}
    if args.relay:  # a relay host: serves Circuit Relay v2 as a relay-role node does
        over["p2p.relay.service"] = "on"
    for kv in args.set:  # --set p2p.key=value (JSON value, else the string)
        key, _, value = kv.partition("=")
        try:
            over[key] = json.loads(value)
        except json.JSONDecodeError:
            over[key] = value
    if args.slow_start_after_idle is not None:  # this lab host's namespace only
        Path("/proc/sys/net/ipv4/tcp_slow_start_after_idle").write_text(
            f"{args.slow_start_after_idle}\n")
    cfg = load_config(None, over)
    node = P2PNode(Identity.generate(), cfg)
    records = []

    async def on_batch(env, peer):
        records.append([peer, env.message.round, time.time(), env.ts_ms / 1000,
                        len(env.payload)])

    def emit(**obj):
        print(json.dumps(obj), flush=True)

    announced: dict[str, list[float]] = {}  # origin -> arrival times of its announces
    pull_announced = node.gossip._pull_announced

    handled: list = []  # (origin, announce's ts_ms, when it reached the asyncio handler)

    # pushed bodies: who pushed each one we claimed and when it had arrived; when we pushed
    # or forwarded one (the first push of a round: from its origin; a forward: after its
    # announce was checked here)
    claims: dict[bytes, tuple] = {}
    bodies: list = []  # (origin, announce handled, body handed over, pusher, pushed at)
    sends: list = []  # ("push" | "forward", time, copies)

    async def timed_pull(kind, env, origin):  # when each announce arrived (before its pull)
        t0 = time.time()
        announced.setdefault(origin, []).append(t0)
        handled.append((origin, env.ts_ms, t0))
        await pull_announced(kind, env, origin)
        got = claims.pop(env.message.content_hash, (None, None))
        bodies.append((origin, t0, time.time(), *got))

    node.gossip._pull_announced = timed_pull
    traces = []  # where each announced body's time went here (pubsub.BodyTrace)

    def on_body(t):
        traces.append([t.via, t.push_waited, t.queued, t.pulling, t.asks,
                       t.source == t.origin, t.hedged, t.hedge_won, t.origin,
                       time.time() - (time.monotonic() - t.announced), t.source])

    node.gossip.on_body = on_body
    lags: list[float] = []  # event-loop lag: how late a LAG_PROBE_S sleep wakes (CPU queueing)

    async def loop_lag():
        while True:
            t0 = time.monotonic()
            await asyncio.sleep(LAG_PROBE_S)
            lags.append(time.monotonic() - t0 - LAG_PROBE_S)

    lag_task = asyncio.create_task(loop_lag())
    await node.start(bootstrap=args.bootstrap)
    await node.subscribe("rollouts", on_batch)
    hops = await install_hop_probes(node)
    pusher = node.gossip.pusher
    if pusher is not None:
        claim, push, forward = pusher.claim, pusher.push, pusher.forward
        wall = time.time() - time.monotonic()

        def timed_claim(digest, size):
            entry = pusher.unclaimed.get(digest)
            if entry is not None:
                claims[digest] = (entry.pusher, entry.at + wall)
            return claim(digest, size)

        def timed_push(*a, **kw):
            n = push(*a, **kw)
            sends.append(("push", time.time(), n))
            return n

        def timed_forward(*a, **kw):
            n = forward(*a, **kw)
            sends.append(("forward", time.time(), n))
            return n

        pusher.claim, pusher.push, pusher.forward = timed_claim, timed_push, timed_forward
    # each bulk-plane ask of a pull: (source, asked at, connection ready, answer's header,
    # body read, whether the connection was pooled, outcome): where a pull's time goes
    asks: list = []
    puller = node.gossip.puller
    if puller is not None:
        b_open, b_ask = puller._open, puller._ask

        async def timed_open(peer, fresh, *a, **kw):
            t0 = time.time()
            conn = await b_open(peer, fresh, *a, **kw)
            conn._probe = [peer, t0, time.time(), 0.0, 0.0, bool(conn.reused), "?"]
            asks.append(conn._probe)
            return conn

        async def timed_ask(conn, digest, size, *a, **kw):
            probe = getattr(conn, "_probe", None)
            read = conn.readexactly

            async def first_read(n):  # the answer's header: the ask's round trip
                out = await read(n)
                if probe is not None and not probe[3]:
                    probe[3] = time.time()
                return out

            conn.readexactly = first_read
            try:
                data = await b_ask(conn, digest, size, *a, **kw)
            except BaseException as e:
                if probe is not None:
                    probe[6] = type(e).__name__
                raise
            finally:
                conn.readexactly = read
            if probe is not None:
                probe[4], probe[6] = time.time(), "ok"
            return data

        puller._open, puller._ask = timed_open, timed_ask
    emit(event="ready", peer_id=node.peer_id, addrs=node.listen_addrs)
    n_others = args.peers - 1
    deadline = time.monotonic() + args.mesh_wait
    # behind a NAT not every peer can be reached: wait for the mesh, not for everyone
    while time.monotonic() < deadline and not (
            len(node.gossip.mesh_peers("rollouts")) >= min(n_others, cfg.p2p.mesh_degree_low)
            and len(node.gossip.topic_peers("rollouts")) >= min(n_others, cfg.p2p.target_peers)):
        await asyncio.sleep(0.1)
    batches = [make_batch(node.peer_id, r, args.batch_kib * 1024) for r in range(args.rounds)]
    lags.clear()  # the rounds' lag only
    emit(event="meshed", topic_peers=len(node.gossip.topic_peers("rollouts")),
         mesh_peers=len(node.gossip.mesh_peers("rollouts")))
    start = json.loads(await asyncio.to_thread(sys.stdin.readline))["start"]
    hops["trio_lag"].clear()  # the rounds' lag only
    cpu0 = time.process_time()  # this process's CPU (every thread) from the first round on
    pub_calls = []
    for r in range(args.rounds):
        delay = start + r * args.interval - time.time()
        if delay > 0:
            await asyncio.sleep(delay)
        pub_calls.append(time.time())
        await node.publish("rollouts", batches[r])
    expected = n_others * args.rounds
    end = time.time() + args.drain
    while len(records) < expected and time.time() < end:
        await asyncio.sleep(0.1)
    # how this node reached each peer at the end: direct, relayed, or not connected
    links = {p: ("relayed" if node.is_relayed(p) else "direct")
             for p in node.connected_peers()}

    async def snapshot() -> dict:  # in the trio thread, which writes the probes' dicts
        return json.loads(json.dumps(hops))

    hops = await node.context.bridge.call(snapshot)
    emit(event="done", peer_id=node.peer_id, records=records,
         metrics=node.metrics.snapshot()["counters"], links=links,
         mesh=node.gossip.mesh_peers("rollouts"), reach=node.reach.current.verdict.value,
         cpu_s=time.process_time(), cpu_rounds_s=time.process_time() - cpu0,
         announced=announced, traces=traces,
         heartbeat_s=node.context.router.heartbeat_interval,
         hops={**hops, "handled": handled, "pub_calls": pub_calls, "bodies": bodies,
               "sends": sends, "asks": asks,
               "trio_lag": [pct(hops["trio_lag"], q) for q in (50, 95, 99)]
               + [max(hops["trio_lag"], default=0.0)]},
         loop_lag=[pct(lags, 50), pct(lags, 95), pct(lags, 99), max(lags, default=0.0)])
    lag_task.cancel()
    await asyncio.to_thread(sys.stdin.readline)
    await node.close()


def gossip_figures(args, n: int, work: Path) -> dict:
    from benchmarks.gossip import summarize_libp2p

    plan = wan_plan(n, seed=args.seed, trainer_mbit=args.trainer_mbit, leg_loss=args.leg_loss)
    hosts = [plan.trainer, *plan.relays, *plan.peers]
    topo = plan.topology
    worker = [sys.executable, str(Path(__file__).resolve()), "--worker", "gossip",
              "--peers", str(n), "--rounds", str(args.rounds), "--interval",
              str(args.interval), "--batch-kib", str(args.batch_kib), "--drain",
              str(args.drain), "--mesh-wait", str(args.mesh_wait),
              *(x for kv in args.set for x in ("--set", kv)),
              *(["--slow-start-after-idle", str(args.slow_start_after_idle)]
                if args.slow_start_after_idle is not None else [])]
    procs: list[LabProc] = []
    with Lab(topo, prefix=args.lab_prefix, seed=args.seed) as lab, \
            hosts_congestion(lab, hosts, args.congestion_control):
        try:
            first = LabProc(lab, hosts[0], [*worker, "--listen",
                                            f"/ip4/{lab.addr(hosts[0])}/tcp/4001"],
                            work / "gossip" / f"{hosts[0]}.log")
            procs.append(first)
            boot = first.event("ready", 120)["addrs"][:1]
            for h in hosts[1:]:
                relay = ["--relay"] if h in plan.relays else []
                procs.append(LabProc(lab, h, [*worker, *relay, "--listen",
                                              f"/ip4/{lab.addr(h)}/tcp/4001",
                                              "--bootstrap", boot[0]],
                                     work / "gossip" / f"{h}.log"))
            for p in procs[1:]:
                p.event("ready", 120 + 5 * n)
            meshed = [p.event("meshed", args.mesh_wait + 60) for p in procs]
            start = time.time() + 2.0
            for p in procs:
                p.send(json.dumps({"start": start}))
            # each worker's RSS and CPU over the publishing window (from outside: the
            # worker's code is the gossip section's), and the machine's busy share
            time.sleep(max(0.0, start - time.time()))
            u0, busy0 = [proc_usage(p) for p in procs], cpu_times()
            window = args.rounds * args.interval
            time.sleep(max(0.0, start + window - time.time()))
            u1, busy1 = [proc_usage(p) for p in procs], cpu_times()
            results = [p.event("done", args.rounds * args.interval + args.drain + 120)
                       for p in procs]
            for r, h in zip(results, hosts, strict=True):
                r["start"] = start
                r["host"] = h
            # every arrival, for a per-pair look at what was late or missing
            (work / "gossip" / "results.json").write_text(json.dumps(results))
            summary = summarize_libp2p(results, args)
            summary["usage"] = worker_usage(results, plan, u0, u1, window)
            summary["busy"] = busy_share(busy0, busy1)
            summary["interval"] = args.interval
            summary["stage"] = lab.stage_stats()
        finally:
            for p in procs:
                p.stop()
    rtts = [topo.path_rtt_ms(a, b) for a, b in itertools.combinations(hosts, 2)]
    slow_up = min(topo.link_of(topo.site_of(h)).up_mbit or 1e6 for h in hosts)
    transfer = args.batch_kib * 1024 * 8 / (slow_up * 1e6)
    summary["bound_s"] = max(rtts) / 1000 + transfer
    summary["bound_parts"] = {"max_rtt_ms": max(rtts), "slowest_up_mbit": slow_up,
                              "transfer_ms": transfer * 1000}
    summary["leg_loss"] = args.leg_loss
    summary["congestion_control"] = args.congestion_control or "inherited"
    summary.update(announce_pull_split(results))
    host_of = {r["peer_id"]: r["host"] for r in results}
    summary["hop_split"] = hop_split(
        results, lambda a, b: topo.path_rtt_ms(host_of[a], host_of[b]) / 2000)
    summary["bodies"] = body_breakdown(results)
    summary["delivery_paths"] = delivery_paths(results, args.interval)
    summary["topic_peers"] = statistics.fmean(m["topic_peers"] for m in meshed)
    # the GossipSub heartbeat each worker ran at the end (py-libp2p's adaptive gossip, off
    # since the meshgossip fix, had set it to 30-60 s from a health score)
    summary["heartbeats_s"] = sorted(r.get("heartbeat_s", 0) for r in results)
    # the workers' CPU from their first round to their last delivery, all together: on a
    # 2-core machine the rounds cannot be shorter than this per round over 2
    summary["cpu_rounds_s"] = sum(r.get("cpu_rounds_s", 0.0) for r in results)
    summary["body_copies"] = body_copies(results)
    summary["nodes"] = n
    return summary


@contextlib.contextmanager
def hosts_congestion(lab: Lab, hosts: list[str], cc: str | None):
    """While the lab runs, each host's default TCP congestion control is `cc` (its
    namespace's sysctl; nothing if None). A namespace other than the init one may make only
    an allowed control its default (EPERM otherwise; here only "reno bbr" are allowed), so
    `cc` joins this machine's net.ipv4.tcp_allowed_congestion_control meanwhile (restored
    after)."""
    if not cc:
        yield
        return
    path = Path("/proc/sys/net/ipv4/tcp_allowed_congestion_control")
    before = path.read_text().split()
    if cc not in before:
        path.write_text(" ".join([*before, cc]) + "\n")
    try:
        for h in hosts:
            lab.run(h, ["sysctl", "-qw", f"net.ipv4.tcp_congestion_control={cc}"], check=True)
        yield
    finally:
        if cc not in before:
            path.write_text(" ".join(before) + "\n")


def host_kind(plan: WanPlan, host: str) -> str:
    """trainer / relay (the hubs every worker dials first) or the host's NAT kind."""
    if host == plan.trainer:
        return "trainer"
    return "relay" if host in plan.relays else plan.nat_of(host)


def worker_usage(results: list[dict], plan: WanPlan, u0: list[dict], u1: list[dict],
                 window: float) -> dict[str, list[dict]]:
    """Per kind, each gossip worker's open connections and GossipSub mesh degree at its end
    (after the drain), its RSS at the end of the publishing window, its CPU s/s over that
    window and its CPU per delivery (first round to last delivery over the batches it got)."""
    usage: dict[str, list[dict]] = {}
    for r, a, b in zip(results, u0, u1, strict=True):
        links = r.get("links", {})
        usage.setdefault(host_kind(plan, r["host"]), []).append({
            "connections": len(links),
            "relayed": sum(v == "relayed" for v in links.values()),
            "mesh": len(r.get("mesh", [])), "rss_mib": b["rss_mib"],
            "cpu_per_s": (b["cpu_s"] - a["cpu_s"]) / window if window else float("nan"),
            "cpu_ms_per_delivery": (1000 * r.get("cpu_rounds_s", float("nan"))
                                    / max(1, len(r.get("records", []))))})
    return usage


def body_copies(results: list[dict]) -> dict:
    """The bodies' copies, all workers together: pushed bodies read (`received`), of them
    duplicates; pushes by path (origin push, forward, forwarded early); pulls; copies per
    delivered body. `gossip_copies_in` counts the gossipsub messages (the announces)."""
    keys = ("payload_push_received", "payload_push_duplicate",
            "payload_pushed", "payload_push_forwarded", "payload_push_forwarded_early",
            "payload_push_forwarded_unnamed", "payload_push_claimed", "payload_fetched",
            "payload_push_failed", "payload_push_broken", "payload_pulled_bulk",
            "payload_pulled_libp2p", "payload_push_adverts", "gossip_copies_in", "received")
    tot = {k: sum(r["metrics"].get(k, 0) for r in results) for k in keys}
    tot["payload_pulled"] = tot["payload_pulled_bulk"] + tot["payload_pulled_libp2p"]
    delivered = max(1, tot["received"])
    tot["body_copies_per_delivery"] = (tot["payload_push_received"]
                                       + tot["payload_pulled"]) / delivered
    tot["announce_copies_per_delivery"] = tot["gossip_copies_in"] / delivered
    return tot


# The gossip workers' loop-lag probes (a sleep in each loop, and how late it wakes). At
# 10 ms the two cost ~32 ms of CPU a second measured alone (trio 19, asyncio 13); in the
# 12-node lab the workers' CPU over the rounds did not fall measurably at 0.1 s (RESULTS
# "wan: gossip": a busy loop wakes anyway), but nothing there needs 10 ms.
LAG_PROBE_S = 0.1


HOP_STAGES = ("seal_to_trio", "queue", "write", "wire", "wire_excess", "sched", "check",
              "validate", "handover")


def hop_split(results: list[dict], one_way_s) -> dict:
    """Each announce's trip (its seal at the origin to the receiver's asyncio handler) cut
    into stages along the path its first copy took (worker probes: install_hop_probes):
    seal_to_trio (the origin's publish reaching its libp2p thread), then per hop: queue
    (from the sender's publish start, or its validation of the copy it forwards, to the
    write of the RPC carrying it to the next peer: the per-peer send queue), write (that
    write: yamux window, Noise, the socket's send buffer), wire (end of the write to the
    next peer's read of the RPC: the path's one-way delay, uplink queues, retransmits;
    wire_excess: less the path's configured one-way delay), sched (the read to its
    push_msg task running), check (seen cache, signature), validate (our topic validator);
    at the receiver, handover (validated to the asyncio handler: subscription channel,
    thread crossing, asyncio loop). `one_way_s(a, b)`: the configured one-way delay between
    two peer ids. Seconds, p50 / p95 / mean over every delivery whose whole path the probes
    saw; `tail`: the stages' means over the slowest 5% of trips."""
    w = {r["peer_id"]: r for r in results if r.get("hops")}
    trips, missing = [], 0
    for rid, r in w.items():
        h = r["hops"]
        handled = {(o, ts): t for o, ts, t in h["handled"]}
        for k, (v0, v1, fwd, ok, ts_ms) in h["valid"].items():
            origin = k.rsplit("/", 1)[0]
            if not ok or origin not in w or (origin, ts_ms) not in handled:
                continue
            stages = _hop_path(w, rid, k, origin, one_way_s, 0)
            if stages is None:
                missing += 1
                continue
            stages["handover"] = handled[origin, ts_ms] - v1
            stages["total"] = handled[origin, ts_ms] - ts_ms / 1000
            trips.append(stages)
    out = {"trips": len(trips), "missing": missing}
    if not trips:
        return out
    keys = [*HOP_STAGES, "total"]
    for name in keys:
        xs = [t.get(name, 0.0) for t in trips]
        out[name] = [pct(xs, 50), pct(xs, 95), statistics.fmean(xs)]
    slow = sorted(trips, key=lambda t: t["total"])[-max(1, len(trips) // 20):]
    out["tail"] = {name: statistics.fmean(t.get(name, 0.0) for t in slow) for name in keys}
    out["hops"] = dict(sorted(Counter(t["n_hops"] for t in trips).items()))
    out["relayed_trips"] = sum(t["relayed"] > 0 for t in trips)
    lags = [r["hops"]["trio_lag"] for r in w.values()]
    out["trio_lag_p95_max"] = max(x[1] for x in lags)
    out["trio_lag_max"] = max(x[3] for x in lags)
    return out


def _hop_path(w: dict, rid: str, k: str, origin: str, one_way_s, depth: int) -> dict | None:
    """The stages of message `k`'s trip from `origin` to `rid` (see hop_split), summed
    over its hops; None where a probe missed a step."""
    r = w[rid]["hops"]
    got = r["valid"].get(k)
    read = r["read"].get(k)
    task = r["task"].get(k)
    if got is None or read is None or task is None or depth > 8:
        return None
    fwd = got[2]
    if fwd not in w:
        return None
    x = w[fwd]["hops"]
    if fwd == origin:
        seq = int(k.rsplit("/", 1)[1])
        pub = next((i for i, p in enumerate(x["published"]) if p[2] == seq), None)
        if pub is None:
            return None
        start = x["published"][pub][0]
        stages = {"seal_to_trio": start - got[4] / 1000, "n_hops": 0, "relayed": 0}
    else:
        stages = _hop_path(w, fwd, k, origin, one_way_s, depth + 1)
        if stages is None:
            return None
        start = x["valid"][k][1]
    write = next((wr for wr in x["writes"].get(k, ()) if wr[0] == rid), None)
    if write is None:
        return None
    _, w0, w1 = write
    wire = read[0] - w1
    add = {"queue": w0 - start, "write": w1 - w0, "wire": wire,
           "wire_excess": wire - one_way_s(fwd, rid), "sched": task - read[0],
           "check": got[0] - task, "validate": got[1] - got[0]}
    for name, v in add.items():
        stages[name] = stages.get(name, 0.0) + v
    stages["n_hops"] += 1
    stages["relayed"] += w[fwd].get("links", {}).get(rid) == "relayed"
    return stages


def delivery_paths(results: list[dict], interval: float) -> dict:
    """Each delivery by how its body came (push, pull: the worker's body traces, an origin's
    k-th in announce order being its round k) and how the receiver was linked to the origin
    at the end (direct, relayed, none): counts and done-time p50 / p95 from the round's
    start; `worst`: how each round's slowest delivery came."""
    start = results[0]["start"]
    cats: dict[str, list[float]] = {}
    worst: dict[int, tuple[float, str]] = {}
    for r in results:
        done = {(o, rnd): t - (start + rnd * interval) for o, rnd, t, _, _ in r["records"]}
        by_origin: dict[str, list] = {}
        for t in r.get("traces", []):
            if len(t) > 10:
                by_origin.setdefault(t[8], []).append(t)
        for origin, traces in by_origin.items():
            link = r.get("links", {}).get(origin, "none")
            for k, t in enumerate(sorted(traces, key=lambda t: t[9])):
                if (origin, k) not in done:
                    continue
                cat, d = f"{t[0]}/{link}", done[origin, k]
                cats.setdefault(cat, []).append(d)
                if k not in worst or d > worst[k][0]:
                    worst[k] = (d, cat)
    return {"paths": {c: [len(v), pct(v, 50), pct(v, 95)] for c, v in sorted(cats.items())},
            "worst": dict(Counter(c for _, c in worst.values()))}


def paths_line(p: dict) -> str:
    if not p.get("paths"):
        return ""
    parts = "; ".join(f"{c} {n}: {a:.2f} / {b:.2f}" for c, (n, a, b) in p["paths"].items())
    return (f" Deliveries by body path / link to the origin (count: done p50 / p95 s from "
            f"the round's start): {parts}. Each round's slowest: {p['worst']}.")


def hop_line(h: dict) -> str:
    """The announce's trip by stage (hop_split), as a sentence."""
    if not h.get("trips"):
        return ""
    parts = ", ".join(f"{name} {h[name][0]:.3f} / {h[name][2]:.3f} / {h['tail'][name]:.3f}"
                      for name in HOP_STAGES)
    return (f" An announce's trip, seal to handler, by stage (s; p50 / mean / mean of the "
            f"slowest 5%; {h['trips']} trips, hops {h['hops']}, {h['relayed_trips']} with a "
            f"relayed hop): total {h['total'][0]:.3f} / {h['total'][2]:.3f} / "
            f"{h['tail']['total']:.3f}; {parts}. libp2p (trio) loop lag: p95 up to "
            f"{h['trio_lag_p95_max']:.3f} s, max {h['trio_lag_max']:.3f} s.")


def announce_pull_split(results: list[dict]) -> dict:
    """Each delivery's time split in two: its announce's travel (origin's seal to arrival)
    and the pull of its body (arrival to delivery). An origin's k-th announce is its batch
    of round k (one publish per round, in order)."""
    ann, pull = [], []
    for r in results:
        got = {(s, rnd): (t, ts) for s, rnd, t, ts, _ in r["records"]}
        for origin, times in r.get("announced", {}).items():
            for k, t_ann in enumerate(sorted(times)):
                if (origin, k) in got:
                    t, ts = got[origin, k]
                    ann.append(t_ann - ts)
                    pull.append(t - t_ann)
    return {"announce_p50": pct(ann, 50), "announce_p95": pct(ann, 95),
            "pull_p50": pct(pull, 50), "pull_p95": pct(pull, 95)}


def body_breakdown(results: list[dict]) -> dict:
    """How the announced bodies came (pushed by their publisher, or pulled) and, for the
    pulled ones, the wait for a pull slot, the pull itself, the sources asked (each a
    request round trip) and whether the origin served it (one hop) or another peer."""
    traces = [t for r in results for t in r.get("traces", [])]
    pushed = [t for t in traces if t[0] == "push"]
    pulled = [t for t in traces if t[0] == "pull"]
    return {"bodies": len(traces), "pushed": len(pushed), "pulled": len(pulled),
            "failed": sum(t[0] == "failed" for t in traces),
            "push_before_announce": sum(t[1] < 0.001 for t in pushed),
            "push_wait_p95": pct([t[1] for t in pushed], 95),
            "pull_push_wait_p95": pct([t[1] for t in pulled], 95),
            "queued_p50": pct([t[2] for t in pulled], 50),
            "queued_p95": pct([t[2] for t in pulled], 95),
            "pulling_p50": pct([t[3] for t in pulled], 50),
            "pulling_p95": pct([t[3] for t in pulled], 95),
            "asks_mean": statistics.fmean([t[4] for t in pulled]) if pulled else 0.0,
            "asks_max": max((t[4] for t in pulled), default=0),
            "from_origin": sum(bool(t[5]) for t in pulled),
            # pulls whose ask stalled past p2p.payload_pull_hedge_s, and those another
            # holder then served first (traces of workers before 291ab0f: 6 fields)
            "hedged": sum(bool(t[6]) for t in traces if len(t) > 7),
            "hedge_won": sum(bool(t[7]) for t in traces if len(t) > 7)}


def body_line(b: dict) -> str:
    if not b.get("bodies"):
        return ""
    return (f" Bodies at their receivers: {b['pushed']} of {b['bodies']} pushed by their "
            f"publisher ({b['push_before_announce']} there before their announce; waited "
            f"for at most {b['push_wait_p95']:.2f} s at p95), {b['pulled']} pulled "
            f"({b['from_origin']} from their origin, one hop; the others from a peer that "
            f"held it, two or more), {b['failed']} failed. A pull waited "
            f"{b['pull_push_wait_p95']:.2f} s (p95) for a push that did not come, "
            f"{b['queued_p50']:.2f} / {b['queued_p95']:.2f} s (p50 / p95) for a pull slot, "
            f"then took {b['pulling_p50']:.2f} / {b['pulling_p95']:.2f} s, asking "
            f"{b['asks_mean']:.1f} sources on average (at most {b['asks_max']}); "
            f"{b.get('hedged', 0)} hedged (an ask unanswered after "
            f"p2p.payload_pull_hedge_s), {b.get('hedge_won', 0)} of them served by the "
            f"hedge.")


def gossip_row(s: dict) -> list:
    return [s["nodes"], f"{s['rounds_complete']}/{s.get('rounds', '?')}",
            f"{s['ratio']:.3f}", s["round_p95"], s["lat_p95"], s["bound_s"],
            s["round_p95"] / s["bound_s"] if s["bound_s"] else float("nan"),
            s["topic_peers"], s["pull_failed"], s["drops"]]


GOSSIP_HEAD = ["nodes", "rounds all-delivered", "delivery ratio", "round p95 s",
               "message p95 s", "bound s (max RTT + transfer)", "p95 / bound (goal <= 2)",
               "topic peers (mean)", "pulls failed", "drops"]


def section_gossip(args, work: Path) -> tuple[str, dict]:
    s = gossip_figures(args, args.nodes, work)
    s["rounds"] = args.rounds
    body = (f"Load before: {args.load_before}. {args.rounds} rounds every {args.interval} s, "
            f"{args.batch_kib} KiB per peer per round; workers bootstrap through the trainer's "
            "host; NAT'd workers wait up to --mesh-wait for a mesh.\n\n"
            + table(GOSSIP_HEAD, [gossip_row(s)]) + "\n\n" + bound_line(s, args)
            + hop_line(s.get("hop_split", {}))
            + paths_line(s.get("delivery_paths", {}))
            + f" Workers' CPU from their first round to their last delivery: "
              f"{s['cpu_rounds_s']:.1f} s in all ({s['cpu_rounds_s'] / args.rounds:.2f} "
              "CPU-s per round)."
            + f" GossipSub heartbeat at the end (s, per worker): {s['heartbeats_s']}."
            + f"\n\nDelay stage: {s['stage']}.")
    return body, s


def bound_line(s: dict, args) -> str:
    b = s["bound_parts"]
    split = (f" Where a message's time goes: its announce arrives in {s['announce_p50']:.2f} s "
             f"(p50) / {s['announce_p95']:.2f} s (p95) after it was sealed, then its body is "
             f"delivered {s['pull_p50']:.2f} / {s['pull_p95']:.2f} s later (a pushed body "
             "there before its announce: at once; a pulled one: a request round trip, then "
             "the transfer)." + body_line(s.get("bodies", {})))
    overrides = f" Worker config overrides: {', '.join(args.set)}." if args.set else ""
    return (f"Bound = slowest path's RTT ({b['max_rtt_ms']:.0f} ms) + one {args.batch_kib} KiB "
            f"batch over the slowest uplink ({b['slowest_up_mbit']:g} Mbit/s: "
            f"{b['transfer_ms']:.0f} ms) = {s['bound_s']:.3f} s; p95 of the rounds complete "
            f"(a round is complete when every node holds every other node's batch of it, "
            f"timed from the round's start).{split}{overrides}")


# broadcast -----------------------------------------------------------------------------------

def make_checkpoint(path: Path, mib: int) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    with open(path / "model.safetensors", "wb") as f:
        f.writelines(os.urandom(MiB) for _ in range(mib))
    (path / "config.json").write_text(json.dumps({"architectures": ["Bench"], "mib": mib}))
    return path


def lower_bound_s(topo: Topology, origin: str, receivers: list[str], size: int) -> float:
    """The P2P distribution bound: max(S/u_origin, S/d_min, N S/(u_origin + sum u_i))."""
    def up(h):
        return topo.link_of(topo.site_of(h)).up_mbit * 1e6 / 8

    def down(h):
        return topo.link_of(topo.site_of(h)).down_mbit * 1e6 / 8

    u_s = up(origin)
    return max(size / u_s, size / min(down(h) for h in receivers),
               len(receivers) * size / (u_s + sum(up(h) for h in receivers)))


def wait_all(procs: list[LabProc], kind: str, deadline: float) -> list[dict | None]:
    """Each process's next `kind` event before `deadline` (time.time()); None for one that
    did not send it in time or exited first."""
    out = []
    for p in procs:
        try:
            out.append(p.event(kind, max(0.01, deadline - time.time())))
        except (TimeoutError, RuntimeError):
            out.append(None)
    return out


def reachability_verdicts(procs: list[LabProc], timeout: float) -> dict[str, str]:
    """Each receiver's own reachability verdict once none is `unknown` (or at `timeout`):
    the trainer publishes then, as a real one does minutes after its followers started. A
    follower behind NAT leaves the trainer's first copies to reachable ones only once it
    knows its verdict (its dial-back checks take ~10 s here)."""
    deadline = time.monotonic() + timeout
    while True:
        verdicts = {}
        for p in procs:
            p.send("stats")
            verdicts[p.host] = p.event("stats", 60).get("reachability", "?")
        if "unknown" not in verdicts.values() or time.monotonic() > deadline:
            return verdicts
        time.sleep(1)


def ours_broadcast(lab: Lab, plan: WanPlan, ckpt: Path, work: Path, timeout: float,
                   peer_set: list[str] = ()) -> dict:
    peer = [sys.executable, "-m", "swarm_node.node.testing.broadcast_peer",
            "--discovery-interval", "5", *(a for kv in peer_set for a in ("--set", kv))]
    procs: list[LabProc] = []

    def start(host: str, role: str, *extra: str) -> LabProc:
        p = LabProc(lab, host, [*peer, "--role", role, "--data-dir", str(work / host),
                                "--listen", f"/ip4/{lab.addr(host)}/tcp/4001", *extra],
                    work / f"{host}.log")
        procs.append(p)
        return p

    try:
        origin = start(plan.trainer, "trainer")
        o = origin.event("ready", 120)
        relays = [start(r, "relay", "--follow", o["peer_id"], "--bootstrap", o["addrs"][0])
                  for r in plan.relays]
        ready = [r.event("ready", 120) for r in relays]
        relay_ids = {r["peer_id"] for r in ready}
        cpu0 = [r.get("cpu_s", 0.0) for r in ready]
        hosts_of = {o["peer_id"]: plan.trainer} | {
            r["peer_id"]: h for r, h in zip(ready, plan.relays, strict=True)}
        boots = [x for r in ready for x in ("--bootstrap", r["addrs"][0])]
        followers = [start(h, "inference", "--follow", o["peer_id"], *boots)
                     for h in plan.peers]
        for f in followers:
            ev = f.event("ready", 120 + 5 * len(followers))
            cpu0.append(ev.get("cpu_s", 0.0))
            hosts_of[ev["peer_id"]] = f.host
        time.sleep(5)  # gossip mesh
        verdicts = reachability_verdicts([*relays, *followers], 120)
        threads0: dict[str, dict] = {}
        cpu_pub = cpu_now(procs, threads0)  # each node's CPU seconds just before the publish
        stage0 = lab.stage_stats()
        tx0 = lab.link_bytes(plan.trainer)["tx"]
        t_cmd = time.time()
        origin.send(f"publish {ckpt} 1")
        pub = origin.event("published", timeout)
        hosts = [*plan.relays, *plan.peers]
        each = wait_all([*relays, *followers], "complete", t_cmd + timeout)
        done = [d for d in each if d is not None]
        t_all = max(d["t"] for d in done) - t_cmd if len(done) == len(each) else None
        stage1 = lab.stage_stats()
        traces, cpu_end, threads1 = {}, {}, {}
        for p in procs:  # every node's served shards, for the per-shard account
            p.send("stats")
            st = p.event("stats", 60)
            traces[p.host] = st.get("trace", [])
            cpu_end[p.host] = st.get("cpu_s", 0.0)
            threads1[p.host] = st.get("cpu_threads") or {}
            if p is origin:
                served = st["server"]
                released = {k: v for k, v in st.get("counters", {}).items()
                            if k.startswith(("seed_released_", "seed_first_"))}
        shard = -(-pub["total"] // pub["shards"])
        by = {"trainer": 0, "relays": 0, "peers": 0}  # whose uplinks carried the copies
        for d in done:
            for peer, s in d["sources"].items():
                kind = ("trainer" if peer == o["peer_id"] else "relays" if peer in relay_ids
                        else "peers")
                by[kind] += s["shards_ok"] * shard
        return {"t_all": t_all, "timeout_s": timeout, "verdicts": verdicts,
                "t_after_publish": max((d["t"] for d in done), default=pub["t"]) - pub["t"],
                "egress": lab.link_bytes(plan.trainer)["tx"] - tx0, "ok": len(done),
                "expected": len(each), "from": by,
                "t_each": {h: round(d["t"] - t_cmd, 2) if d else None
                           for h, d in zip(hosts, each, strict=True)},
                "fails": {k: sum(d["metrics"].get(k, 0) for d in done) for k in sorted(
                    {k for d in done for k in d["metrics"] if k.startswith(("fail_", "seeded", "endgame_"))})},
                "sources": {h: d["sources"] for h, d in zip(hosts, each, strict=True) if d},
                "trainer_shard_bytes": served.get("bytes_sent", 0),
                # receivers' CPU from ready to complete, against what the machine has
                "receivers_cpu_s": sum(d.get("cpu_s", 0.0) - c for d, c in
                                       zip(each, cpu0, strict=True) if d),
                "cores": os.cpu_count(),
                "trainer_seeded": served.get("error_seeded", 0), "seed_released": released,
                "shards": shard_account(traces, hosts_of, plan, verdicts, t_cmd),
                "t_publish": round(pub["t"] - t_cmd, 2),
                "timelines": receiver_timelines(traces, hosts_of, plan, verdicts, t_cmd, {
                    h: d["t"] - t_cmd for h, d in zip(hosts, each, strict=True) if d}),
                "metrics_each": {h: d["metrics"] for h, d in zip(hosts, each, strict=True)
                                 if d},
                # each node's CPU seconds by thread kind, from the publish command until
                # the stats after the last copy
                "cpu_threads_each": {h: {k: round(v - threads0.get(h, {}).get(k, 0.0), 2)
                                         for k, v in t.items() if ":" not in k}
                                     for h, t in threads1.items()},
                # each receiver's transfers as its downloader saw them (start, end: s from
                # the publish command; shard, source host, outcome, bytes received)
                "flights_each": {h: [(round(a - t_cmd, 2), round(b - t_cmd, 2), sh,
                                      hosts_of.get(p, p[-6:]), oc, n)
                                     for a, b, sh, p, oc, n in d.get("flights", [])]
                                 for h, d in zip(hosts, each, strict=True) if d},
                "machine": machine_account(cpu_pub, cpu_end, stage0, stage1,
                                           time.time() - t_cmd)}
    finally:
        for p in procs:
            p.stop()


def flight_phases(flights: dict[str, list]) -> dict:
    """From the receivers' flight logs: the swarm's verified-copy rate in each second after
    the publish command (MB/s: bytes of transfers that verified, spread over each one's
    time), all bytes received likewise, the transfers in flight, and per receiver when
    its endgame could begin (every missing shard in flight) and its last transfer ended.
    Where the time goes: the middle of a run is the lab's rate, the ramp and the tail the
    protocol's."""
    end = max((e for fl in flights.values() for _s, e, *_ in fl), default=0.0)
    secs = int(end) + 1
    useful, total, flows = [0.0] * secs, [0.0] * secs, [0.0] * secs
    for fl in flights.values():
        for a, e, _sh, _src, oc, nb in fl:
            if "seeded" in oc or oc == "busy":
                continue
            for k in range(int(a), min(secs, int(e) + 1)):
                ov = max(0.0, min(e, k + 1) - max(a, k))
                r = nb * ov / max(e - a, 1e-3) / 1e6
                total[k] += r
                flows[k] += ov
                if oc in ("ok", "spare_ok"):
                    useful[k] += r
    endgame = {}
    for h, fl in flights.items():
        done = sorted(e for _a, e, _sh, _src, oc, _nb in fl if oc in ("ok", "spare_ok"))
        n = len(done)
        t = 0.0
        while n and t < done[-1]:
            missing = n - sum(1 for e in done if e <= t)
            busy = {sh for a, e, sh, _src, oc, _nb in fl
                    if a <= t < e and "seeded" not in oc and oc != "busy"}
            if 0 < missing <= len(busy):
                endgame[h] = round(t, 1)
                break
            t += 0.1
    return {"useful_mb_s": [round(x, 1) for x in useful],
            "received_mb_s": [round(x, 1) for x in total],
            "flows": [round(x, 1) for x in flows], "endgame_from": endgame}


def phases_line(ours: dict | None) -> str:
    """The swarm's verified-copy rate by second, and the receivers' endgames (flight_phases)."""
    ph = (ours or {}).get("phases")
    if not ph or not ph.get("useful_mb_s"):
        return ""
    eg = ph["endgame_from"]
    ends = (ours or {}).get("t_each") or {}
    spans = [ends[h] - t for h, t in eg.items() if ends.get(h) is not None]
    line = (" Verified copies, MB/s by second from the publish: "
            + " ".join(f"{x:.0f}" for x in ph["useful_mb_s"]))
    if spans:
        line += (f"; each receiver's endgame (every missing shard in flight) began"
                 f" {min(eg.values()):.1f}-{max(eg.values()):.1f} s and lasted"
                 f" {min(spans):.1f}-{max(spans):.1f} s")
    return line + "."


def cpu_now(procs: list[LabProc], threads: dict | None = None) -> dict[str, float]:
    """Each node's own CPU seconds now (its `stats` answer); `threads`: filled with each
    node's CPU seconds by thread kind."""
    out = {}
    for p in procs:
        p.send("stats")
        st = p.event("stats", 60)
        out[p.host] = st.get("cpu_s", 0.0)
        if threads is not None:
            threads[p.host] = st.get("cpu_threads") or {}
    return out


def machine_account(cpu0: dict[str, float], cpu1: dict[str, float], stage0: dict,
                    stage1: dict, window_s: float) -> dict:
    """What the broadcast cost the machine, from the publish command until the stats after
    the last copy: each node's CPU seconds, the delay stage's (and how many packets it
    released late: it fell behind), against the cores' CPU seconds in that window."""
    nodes = {h: round(cpu1.get(h, 0.0) - c, 2) for h, c in cpu0.items()}
    stage = {k: stage1.get(k, 0) - stage0.get(k, 0) for k in
             ("cpu_s", "packets", "bytes", "lost", "late_2ms", "late_10ms", "tun_drops",
              "reads")}
    stage["late_s_max"] = stage1.get("late_s_max")
    total = sum(nodes.values()) + stage.get("cpu_s", 0.0)
    cores = os.cpu_count() or 1
    return {"window_s": round(window_s, 2), "nodes_cpu_s": nodes, "stage": stage,
            "cpu_s_total": round(total, 2), "cores": cores,
            "cpu_share": round(total / (cores * window_s), 3) if window_s > 0 else None}


def receiver_timelines(traces: dict[str, list], hosts_of: dict[str, str], plan: WanPlan,
                       verdicts: dict[str, str], t0: float,
                       done: dict[str, float]) -> dict:
    """Per receiver, from every node's served-shard trace: each shard it took (start, end,
    shard, from), when it finished, how much of its download had a transfer in flight
    (`busy_s`) and how many on average (`mean_flights`), its first and last transfer, and
    the `seeded` answers the trainer gave it (times). Where a receiver's time went."""
    rows: dict[str, list] = {}
    seeded: dict[str, list] = {}
    for host, trace in traces.items():
        for start, end, _v, shard, peer, outcome in trace:
            to = hosts_of.get(peer, peer[-6:])
            if outcome == "seeded":
                seeded.setdefault(to, []).append(round(start - t0, 2))
            else:
                rows.setdefault(to, []).append(
                    (round(start - t0, 2), round(end - t0, 2), shard, host, outcome))
    out = {}
    for h in [*plan.relays, *plan.peers]:
        rs = sorted(rows.get(h, []))
        sent = [r for r in rs if r[4] == "sent"]
        busy, cur_s, cur_e, total = 0.0, None, None, 0.0
        for s, e, *_ in sent:
            total += e - s
            if cur_e is None or s > cur_e:
                if cur_e is not None:
                    busy += cur_e - cur_s
                cur_s, cur_e = s, e
            else:
                cur_e = max(cur_e, e)
        if cur_e is not None:
            busy += cur_e - cur_s
        end = done.get(h)
        first = sent[0][0] if sent else None
        span = (end - first) if end is not None and first is not None else None
        kinds = Counter("trainer" if r[3] == plan.trainer else "relay"
                        if r[3] in plan.relays else "peer" for r in sent)
        out[h] = {"kind": "relay" if h in plan.relays else verdicts.get(h, "?"),
                  "done": round(end, 2) if end is not None else None,
                  "first_start": first, "last_end": sent[-1][1] if sent else None,
                  "busy_s": round(busy, 2), "idle_s": round(span - busy, 2) if span else None,
                  "mean_flights": round(total / span, 2) if span else None,
                  "from": dict(kinds), "cut": sum(r[4] == "cut" for r in rs),
                  "seeded": seeded.get(h, []), "shards": sent}
    return out


def shard_account(traces: dict[str, list], hosts_of: dict[str, str], plan: WanPlan,
                  verdicts: dict[str, str], t0: float) -> dict:
    """Per shard, from every node's served-shard trace (server.py `trace`): the trainer's
    copies (when, to whom, of which reachability), its `seeded` answers, and whether the
    holders served on: for each copy after a shard's first, how many peers held the shard
    then and how many uploads of it the other holders completed in the `hold` seconds
    before it (uploads going on mean the swarm was carrying it when the trainer gave it
    again)."""
    trainer = plan.trainer
    sent = []  # (start, end, shard, from host, to host) of every whole upload
    seeded, seeded_to = Counter(), Counter()
    for host, rows in traces.items():
        for start, end, _v, shard, peer, outcome in rows:
            to = hosts_of.get(peer, peer[-6:])
            if outcome == "sent":
                sent.append((start - t0, end - t0, shard, host, to))
            elif outcome == "seeded" and host == trainer:
                seeded[shard] += 1
                seeded_to[to] += 1

    def kind(h: str) -> str:
        return "relay" if h in plan.relays else verdicts.get(h, "?")
    copies: dict[int, list] = {}
    for start, end, shard, src, to in sorted(sent):
        if src == trainer:
            copies.setdefault(shard, []).append((start, end, to))
    again = []
    for shard, cs in copies.items():
        for k, (start, _end, to) in enumerate(cs[1:], 1):
            held = {t for s, e, sh, _f, t in sent if sh == shard and e <= start}
            busy = sum(1 for s, e, sh, f, _t in sent
                       if sh == shard and f != trainer and e > start - 5 and s < start)
            served_on = {c[2]: sum(1 for _s, e, sh, f, _t in sent if sh == shard and f == c[2]
                                   and e <= start) for c in cs[:k]}
            again.append({"shard": shard, "copy": k + 1, "t": round(start, 2), "to": to,
                          "to_kind": kind(to), "gap_s": round(start - cs[k - 1][0], 2),
                          "holders": len(held), "other_uploads_5s": busy,
                          "earlier_holders_served": served_on})
    return {"copies": {s: [(round(a, 2), round(b, 2), t, kind(t)) for a, b, t in cs]
                       for s, cs in sorted(copies.items())},
            "seeded": dict(seeded), "seeded_to": dict(seeded_to), "again": again,
            "served_by": dict(Counter(f for _s, _e, _sh, f, _t in sent))}


SHARDCAST_WRAPPER = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("shardcast_peer", sys.argv[1])
peer = importlib.util.module_from_spec(spec)
spec.loader.exec_module(peer)
def bind_lab():
    from shardcast import server
    class LabServer(server.ShardcastServer):
        def __init__(self, address, directory, shutdown_event=None):
            super().__init__(("0.0.0.0", 0), directory, shutdown_event)
    server.ShardcastServer = LabServer
peer.patch_bind = bind_lab  # inside a lab host 0.0.0.0 is that host's lab address only
sys.argv = sys.argv[1:]
sys.exit(peer.main())
"""


def shardcast_broadcast(lab: Lab, plan: WanPlan, blob: Path, work: Path,
                        timeout: float) -> dict:
    base = [str(SHARDCAST_PY), "-c", SHARDCAST_WRAPPER, str(SHARDCAST_PEER)]
    procs: list[LabProc] = []

    def start(host: str, *args: str) -> LabProc:
        p = LabProc(lab, host, [*base, *args], work / f"{host}.log")
        procs.append(p)
        return p

    def url(host: str, ev: dict) -> str:  # the peer prints 127.0.0.1: use its lab address
        return f"http://{lab.addr(host)}:{ev['url'].rsplit(':', 1)[1]}"

    try:
        origin = start(plan.trainer, "origin", str(work / "origin"), str(blob))
        o_url = url(plan.trainer, origin.event("ready", 120))
        # one at a time: shardcast's downloaders probe each server through one shared file
        # (/tmp/dummy.bin) and race on it when started together
        m_urls = [url(r, start(r, "middle", str(work / r), o_url).event("ready", 120))
                  for r in plan.relays]
        clients = []
        for i, h in enumerate(plan.peers):
            c = start(h, "client", str(work / h), m_urls[i % len(m_urls)])
            c.event("ready", 120)
            clients.append(c)
        tx0 = lab.link_bytes(plan.trainer)["tx"]
        t_cmd = time.time()
        origin.send("go")
        origin.event("published", timeout)
        done = [d or {"event": "stuck"} for d in wait_all(clients, "any", t_cmd + timeout)]
        ok = [d for d in done if d.get("event") == "complete"]
        # the middles (relays) hold a copy too but report nothing: clients are counted
        return {"t_all": (max(d["t"] for d in ok) - t_cmd) if len(ok) == len(done) else None,
                "timeout_s": timeout,
                "egress": lab.link_bytes(plan.trainer)["tx"] - tx0, "ok": len(ok),
                "expected": len(done),
                "ended": {h: d.get("event") for h, d in zip(plan.peers, done, strict=True)}}
    finally:
        for p in procs:
            p.stop()


def section_broadcast(args, work: Path) -> tuple[str, dict]:
    """Ours, then shardcast in a fresh lab of the same plan. Each half has `--half-timeout`
    seconds from its publish command (one that runs out is recorded as not finished) and
    is recorded as it ends: a half that hangs or a run killed later loses nothing before."""
    plan = wan_plan(args.nodes, seed=args.seed, trainer_mbit=args.trainer_mbit)
    ckpt = make_checkpoint(work / "ckpt", args.mib)
    size = (ckpt / "model.safetensors").stat().st_size
    receivers = [*plan.relays, *plan.peers]
    bound = lower_bound_s(plan.topology, plan.trainer, receivers, size)
    out = {"bound_s": bound, "size": size, "receivers": len(receivers),
           "relays": len(plan.relays), "followers": len(plan.peers),
           "homes": len(plan.topology.homes)}
    with Lab(plan.topology, prefix=args.lab_prefix, seed=args.seed) as lab, \
            hosts_congestion(lab, [plan.trainer, *receivers], args.congestion_control):
        out["ours"] = ours_broadcast(lab, plan, ckpt, work / "ours", args.half_timeout,
                                     args.peer_set)
        out["congestion_control"] = args.congestion_control or "inherited"
        out["ours"]["phases"] = flight_phases(out["ours"].get("flights_each") or {})
    if SHARDCAST_PY.exists() and not args.skip_shardcast:
        record_half(args, out, "shardcast pending (running next)")
        with Lab(plan.topology, prefix=args.lab_prefix, seed=args.seed) as lab:
            out["shardcast"] = shardcast_broadcast(lab, plan, ckpt / "model.safetensors",
                                                   work / "shardcast", args.half_timeout)
    return broadcast_body(args, out), out


def record_half(args, out: dict, pending: str) -> None:
    """Print (and unless --no-record, record) the section with the halves run so far."""
    body = broadcast_body(args, out, pending)
    print(f"\n## wan: broadcast (so far)\n\n{body}\n", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"broadcast": out}, indent=1, default=str))
    if not args.no_record:
        record("wan: broadcast", body, headline=headlines("broadcast", out, args))


def verdict_line(ours: dict | None) -> str:
    if not ours or not ours.get("verdicts"):
        return ""
    n = Counter(ours["verdicts"].values())
    return (" Receivers' own reachability verdicts at the publish: "
            + ", ".join(f"{k} {v}" for k, v in sorted(n.items())) + ".")


def endgame_line(ours: dict | None, size: int) -> str:
    """The receivers' endgame (downloader.py): second copies raced, won, and their bytes."""
    f = (ours or {}).get("fails") or {}
    if not f.get("endgame_copies"):
        return " Endgame: no second copy raced."
    return (f" Endgame (all receivers): {f['endgame_copies']} second copies raced, "
            f"{f.get('endgame_won', 0)} verified first; bytes of the second copies "
            f"{f.get('endgame_bytes', 0) / size:.2f}x the checkpoint, of the losers (wasted) "
            f"{f.get('endgame_bytes_wasted', 0) / size:.2f}x.")


def seed_line(ours: dict | None) -> str:
    """The trainer's copies per shard, and of the copies after a shard's first, how many
    went out while other holders were uploading that shard (shard_account)."""
    acc = (ours or {}).get("shards")
    if not acc or not acc.get("copies"):
        return ""
    per = sorted(len(c) for c in acc["copies"].values())
    again = acc["again"]
    busy = sum(1 for a in again if a["other_uploads_5s"])
    kinds = Counter(a["to_kind"] for a in again)
    return (f" Trainer copies per shard: {min(per)}-{max(per)} (median "
            f"{statistics.median(per):g}, {len(per)} shards); {len(again)} copies after a "
            f"shard's first, {busy} of them while other holders had uploads of that shard in "
            f"the 5 s before; to " + ", ".join(f"{k} {v}" for k, v in sorted(kinds.items()))
            + f"; `seeded` answers {sum(acc['seeded'].values())}.")


def machine_line(ours: dict | None) -> str:
    """What the lab carried (machine_account) and how busy each receiver's download was
    (receiver_timelines): the delay stage's rate, CPU and late packets, the cores' share
    used by the nodes and the stage, and the share of each download with a transfer in
    flight."""
    m = (ours or {}).get("machine")
    if not m or not m.get("window_s"):
        return ""
    st, w = m["stage"], m["window_s"]
    late = st.get("late_10ms", 0) / max(1, st.get("packets", 0))
    line = (f" Lab: the delay stage carried {st.get('bytes', 0) / w / 1e6:.1f} MB/s"
            f" ({st.get('bytes', 0) / 1e6:.0f} MB in {w:.1f} s) on"
            f" {st.get('cpu_s', 0.0) / w:.0%} of a core, {late:.0%} of its packets released"
            f" > 10 ms late; the nodes and the stage used {m['cpu_share']:.0%} of the"
            f" {m['cores']} cores")
    busy = [t["busy_s"] / (t["done"] - t["first_start"]) for t in
            (ours.get("timelines") or {}).values()
            if t.get("done") and t.get("first_start") is not None and t["done"] > t["first_start"]]
    if busy:
        line += (f"; each receiver had a transfer in flight {min(busy):.0%}-{max(busy):.0%} of"
                 " its download")
    return line + "."


def broadcast_body(args, out: dict, pending: str = "not run (no .venv-shardcast)") -> str:
    size, bound = out["size"], out["bound_s"]
    rows = []
    for name in ("ours", "shardcast"):
        r = out.get(name)
        if r is None:
            rows.append([name, pending, "-", "-", "-", "-"])
            continue
        t = r["t_all"]
        by = r.get("from")
        carried = ("-" if by is None else " / ".join(
            f"{by[k] / size:.1f}" for k in ("trainer", "relays", "peers")))
        rows.append([name, f"{r['ok']}/{r['expected']}",
                     t if t is not None else f"did not finish in {r['timeout_s']:.0f} s",
                     t / bound if t else "-", r["egress"] / size, carried])
    return (f"Load before: {args.load_before}. {args.mib} MiB from the trainer "
            f"({args.trainer_mbit:.0f} Mbit/s) to {out['receivers']} receivers ({out['relays']} "
            f"relays + {out['followers']} followers, {out['homes']} behind NATs); "
            f"bandwidth lower bound {bound:.1f} s. Time from the publish command until every "
            "receiver verified its copy (shardcast: every client; its middles on the relays report "
            "nothing); egress counted on the trainer's access link."
            + verdict_line(out.get("ours")) + endgame_line(out.get("ours"), size)
            + seed_line(out.get("ours"))
            + machine_line(out.get("ours")) + phases_line(out.get("ours")) + "\n\n"
            + table(["system", "copies verified", "time s", "x lower bound (goal <= 1.5)",
                     "trainer egress / checkpoint (goal <= 2)",
                     "copies served by trainer / relays / peers"], rows))


# scaling --------------------------------------------------------------------------------------

def scaling_interval(args, n: int) -> float:
    """The gossip interval at `n` nodes: `--interval`, or with `--scaling-interval-per-peer`
    that many s per other node (every node then receives the same bodies/s at every N)."""
    per_peer = args.scaling_interval_per_peer
    return round(per_peer * (n - 1), 2) if per_peer else args.interval


def section_scaling(args, work: Path, model_dir: Path) -> tuple[str, dict]:
    if args.scaling_layer == "p2p":
        return section_scaling_p2p(args, work)
    out = {}
    for n in args.scaling:
        try:
            sw = swarm_figures(args, n, work / f"scale{n}", model_dir, steady_only=True)
            g = gossip_figures(args, n, work / f"scale{n}")
        except Exception as e:  # noqa: BLE001 - a size this machine cannot hold is a figure
            out[n] = {"failed": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
            continue
        g["rounds"] = args.rounds
        out[n] = {"swarm": sw, "gossip": g}
    return scaling_body(args, out), out


def scaling_body(args, out: dict) -> str:
    rows, grows, starts = [], [], []
    for n, o in out.items():
        if "failed" in o:
            starts.append([n, "failed", o["failed"], "-", "-", "-", "-"])
            continue
        sw, g = o["swarm"], o["gossip"]
        for row in usage_rows(sw):
            rows.append([n, *row])
        grows.append(gossip_row(g))
        firsts = [t for v in sw["first_accepted_s"].values() for t in v]
        ok = [t for t in firsts if t is not None]
        starts.append([n, sw.get("all_started_s"), f"{len(ok)}/{len(firsts)}",
                       sum(t <= 60 for t in ok), pct(ok, 50), max(ok, default=float("nan")),
                       sw["steady"]["versions"]])
    return (f"Load before: {args.load_before}. The swarm section's steady state and the gossip "
            f"section at {', '.join(map(str, out))} nodes. Per-node figures should stay "
            "flat as N grows.\n\n"
            + table(["N", "all started s", "peers contributed", "within 60 s of launch",
                     "first accepted p50 s", "max s", "trainer +versions in steady state"],
                    starts) + "\n\n"
            + table(["N", "kind", "n", "connections", "RSS MiB", "CPU s/s"], rows) + "\n\n"
            + table(GOSSIP_HEAD, grows))


def section_scaling_p2p(args, work: Path) -> tuple[str, dict]:
    """The p2p layer alone (gossip workers: our P2PNode, no model) at each `--scaling` N."""
    out = {}
    for n in args.scaling:
        a = argparse.Namespace(**{**vars(args), "interval": scaling_interval(args, n)})
        try:
            with LoadSampler() as loads:
                g = gossip_figures(a, n, work / f"p2p{n}")
        except Exception as e:  # noqa: BLE001 - a size this machine cannot hold is a figure
            out[n] = {"failed": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
            continue
        g["rounds"], g["load"] = args.rounds, loads.summary()
        out[n] = {"gossip": g}
    return scaling_p2p_body(args, out), out


def p2p_usage_rows(out: dict) -> list[list]:
    """Per N and node kind: mean (min-max) connections, mesh degree, RSS, CPU."""
    rows = []
    for n, o in out.items():
        if "failed" in o:
            rows.append([n, "failed", o["failed"], "-", "-", "-", "-", "-", "-"])
            continue
        for kind, items in sorted(o["gossip"]["usage"].items()):
            conns = [i["connections"] for i in items]
            rows.append([n, kind, len(items),
                         f"{statistics.fmean(conns):.1f} ({min(conns)}-{max(conns)})",
                         sum(i["relayed"] for i in items),
                         statistics.fmean(i["mesh"] for i in items),
                         statistics.fmean(i["rss_mib"] for i in items),
                         statistics.fmean(i["cpu_per_s"] for i in items),
                         statistics.fmean(i["cpu_ms_per_delivery"] for i in items)])
    return rows


def scaling_p2p_body(args, out: dict) -> str:
    runs = []
    for n, o in out.items():
        if "failed" in o:
            continue
        g = o["gossip"]
        cores = sum(i["cpu_per_s"] for v in g["usage"].values() for i in v)
        runs.append([n, g["interval"], (n - 1) / g["interval"],
                     f"{g['rounds_complete']}/{g['rounds']}", f"{g['ratio']:.3f}",
                     f"{g['round_p50']:.2f} / {g['round_p95']:.2f}", g["lat_p95"],
                     g["pull_failed"], cores, g["busy"], g["load"]])
    return (f"Load before: {args.load_before}. The p2p layer alone: `--sections gossip` workers "
            "(our P2PNode: connection manager, GossipSub, pushes and pulls; no model) in the "
            f"same `wan_plan` at {', '.join(map(str, out))} nodes, {args.rounds} rounds of "
            f"{args.batch_kib} KiB per node"
            + (f", interval {args.scaling_interval_per_peer:g} s per other node (each node "
               "receives the same bodies/s at every N)" if args.scaling_interval_per_peer
               else f", interval {args.interval:g} s") + ". Connections and mesh at each "
            "worker's end; RSS at the end of the publishing window; CPU s/s over it; CPU "
            "per delivery from the first round to the last delivery.\n\n"
            + table(["N", "interval s", "bodies/s a node receives", "rounds all-delivered",
                     "delivery ratio", "round p50 / p95 s", "message p95 s", "pulls failed",
                     "workers' cores", "machine busy", "1-min load"], runs) + "\n\n"
            + table(["N", "kind", "n", "connections mean (min-max)", "relayed", "mesh degree",
                     "RSS MiB", "CPU s/s", "CPU ms per delivery"], p2p_usage_rows(out)))


# headline rows ----------------------------------------------------------------------------------

def headlines(name: str, out: dict, args) -> list[Headline]:
    """The section's rows of RESULTS.md's headline table (issue #27's goals)."""
    if name == "pair":
        accepted = sum(o[p]["accepted"] > 0 for o in out.values() for p in ("peer1", "peer2"))
        firsts = [t for o in out.values() for t in o["first_accepted_s"].values()]
        links = ", ".join(f"{k} {o['links'].get('peer1-peer2', 'none')}"
                          for k, o in out.items())
        return [Headline("wan: NAT'd pair (public trainer + relay), every NAT combination",
                         "both contribute within 60 s and hot-load; cone pair direct, "
                         "others relayed",
                         f"{accepted}/{2 * len(out)} peers accepted (first at "
                         f"{min(firsts, default=0):.0f}-{max(firsts, default=0):.0f} s after "
                         f"its start); peer1-peer2: {links}")]
    if name == "swarm":
        natted = [t for k, v in out["first_accepted_s"].items() if k != "public" for t in v]
        ok = [t for t in natted if t is not None and t <= 60]
        late = sum(t is not None for t in natted) - len(ok)
        pairs = out["steady"]["connected_pairs"]
        d, r, _ = pairs.get("cone/cone", [0, 0, 0])
        un = out["steady"].get("unconnected_pairs", {}).get("cone/cone")
        reach = out["steady"]["reachable"]
        return [Headline(f"wan: NAT'd peers' first accepted rollout ({out['nodes']} nodes)",
                         "every one within 60 s of its start",
                         f"{len(ok)}/{len(natted)} within 60 s, {late} later (max "
                         f"{max((t for t in natted if t is not None), default=float('nan')):.0f}"
                         f" s), {len(natted) - len(ok) - late} not within the "
                         f"{args.contribute_timeout:.0f} s watch"),
                Headline(f"wan: reachable by any peer, per NAT type ({out['nodes']} nodes)",
                         "100% for every type", ", ".join(
                             f"{k} {100 * c / t:.0f}% ({c}/{t})"
                             for k, (c, t) in sorted(reach.items()) if t)),
                Headline(f"wan: connected cone-NAT pairs direct ({out['nodes']} nodes)",
                         ">= 95%", f"{d}/{d + r} direct" + (
                             f" ({100 * d / (d + r):.0f}%)" if d + r else "") + (
                             f"; {un['full'] + un['short']} unconnected ({un['full']} both at "
                             f"target_peers, {un['short']} short)" if un else ""))]
    if name == "gossip":
        return [Headline(f"wan: gossip rounds, p95 / (slowest RTT + transfer) "
                         f"({out['nodes']} nodes)", "100% rounds; <= 2x",
                         f"{out['rounds_complete']}/{out['rounds']} rounds; "
                         f"{out['round_p95'] / out['bound_s']:.1f}x "
                         f"({out['round_p95']:.2f} s vs {out['bound_s']:.2f} s)")]
    if name == "broadcast":
        ours, sc = out["ours"], out.get("shardcast")
        t = ours["t_all"]
        took = (f"{t / out['bound_s']:.1f}x ({t:.0f} s, bound {out['bound_s']:.0f} s)" if t
                else f"{ours['ok']}/{ours['expected']} within {ours['timeout_s']:.0f} s")
        return [Headline("wan: checkpoint broadcast to every follower (time vs bandwidth "
                         "bound, trainer egress)",
                         "<= 1.5x the bandwidth bound; trainer egress <= 2x; ahead of "
                         "shardcast",
                         f"{args.mib} MiB to {ours['expected']} receivers: {took}"
                         f"; egress {ours['egress'] / out['size']:.1f}x",
                         f"shardcast {sc['t_all']:.0f} s, egress "
                         f"{sc['egress'] / out['size']:.1f}x" if sc and sc["t_all"]
                         else "shardcast not run or incomplete")]
    if name == "scaling" and args.scaling_layer == "p2p":
        per_n = []
        for n, o in out.items():
            if "failed" in o:
                per_n.append(f"N={n}: failed")
                continue
            usage = o["gossip"]["usage"]
            items = [i for k, v in usage.items() if k not in ("trainer", "relay") for i in v]
            hubs = [i["connections"] for k in ("trainer", "relay") for i in usage.get(k, [])]
            per_n.append(f"N={n}: peers {statistics.fmean(i['connections'] for i in items):.1f}"
                         f" conns (max {max(i['connections'] for i in items)}), "
                         f"{statistics.fmean(i['rss_mib'] for i in items):.0f} MiB, "
                         f"{statistics.fmean(i['cpu_ms_per_delivery'] for i in items):.1f} ms "
                         f"CPU/delivery; hubs {min(hubs)}-{max(hubs)} conns; "
                         f"ratio {o['gossip']['ratio']:.3f}")
        return [Headline("wan: per-node connections, RSS, CPU as N grows", "flat",
                         "p2p layer (gossip workers, no model): " + "; ".join(per_n))]
    if name == "scaling":
        per_n = []
        for n, o in out.items():
            if "failed" in o:
                per_n.append(f"N={n}: failed")
                continue
            usage = o["swarm"]["steady"]["usage"]
            # inference peers (every NAT kind) apart from the hubs every peer connects to
            items = [i for k, v in usage.items() if k not in ("trainer", "relay") for i in v]
            hubs = [i["connections"] for k in ("trainer", "relay") for i in usage.get(k, [])]
            per_n.append(f"N={n}: peers {statistics.fmean(i['connections'] for i in items):.1f} "
                         f"conns, {statistics.fmean(i['rss_mib'] for i in items):.0f} MiB, "
                         f"{statistics.fmean(i['cpu_per_s'] for i in items):.2f} CPU"
                         + (f"; trainer/relays {min(hubs)}-{max(hubs)} conns" if hubs else ""))
        return [Headline("wan: per-node connections, RSS, CPU as N grows", "flat",
                         "; ".join(per_n))]
    return []


# main -------------------------------------------------------------------------------------------

def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    ap.add_argument("--nodes", type=int, default=30)
    ap.add_argument("--scaling", type=int, nargs="+", default=[10, 20, 40])
    ap.add_argument("--scaling-layer", choices=["full", "p2p"], default="full",
                    help="scaling: full `swarm-node join` nodes (swarm steady state and "
                         "gossip), or the p2p layer alone (gossip workers, no model)")
    ap.add_argument("--scaling-interval-per-peer", type=float, metavar="S",
                    help="scaling: the gossip interval at N nodes is S * (N - 1) (the same "
                         "receive load per node at every N) instead of --interval")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--trainer-mbit", type=float, default=1000.0)
    ap.add_argument("--leg-loss", type=float, default=LEG_LOSS,
                    help="gossip: random loss per leg (a path has two), LEG_LOSS by default")
    ap.add_argument("--workdir", type=Path)
    ap.add_argument("--no-record", action="store_true")
    ap.add_argument("--json", type=Path, help="also write every figure here")
    # stage
    ap.add_argument("--stage-rates", type=int, nargs="+", default=[5000, 20000, 40000])
    ap.add_argument("--stage-tcp-mib", type=int, default=200)
    ap.add_argument("--stage-losses", type=float, nargs="+", default=[0.0, 0.005, 0.01])
    # pair
    ap.add_argument("--pair-nats", nargs="+", type=lambda s: tuple(s.split("/")),
                    default=[("cone", "cone"), ("cone", "symmetric"),
                             ("symmetric", "symmetric")])
    ap.add_argument("--pair-versions", type=int, default=3)
    ap.add_argument("--pair-timeout", type=float, default=300.0)
    # swarm
    ap.add_argument("--contribute-timeout", type=float, default=300.0)
    ap.add_argument("--steady-s", type=float, default=60.0)
    ap.add_argument("--churn-minutes", type=int, default=3)
    ap.add_argument("--partition-s", type=float, default=60.0)
    ap.add_argument("--converge-timeout", type=float, default=300.0)
    ap.add_argument("--node-set", action="append", default=[], metavar="KEY=VALUE",
                    help="swarm: a config override for every node (node.log_level=DEBUG)")
    ap.add_argument("--launch-gap", default="0", metavar="S|running",
                    help="swarm: launch the boot peers one at a time, S s apart, or each "
                         "once the one before says 'running' in its /status (at most "
                         f"{LAUNCH_RUNNING_MAX_S:.0f} s); '0' (default): all at once")
    # gossip
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--interval", type=float, default=1.0)
    ap.add_argument("--batch-kib", type=int, default=64)
    ap.add_argument("--drain", type=float, default=30.0)
    ap.add_argument("--mesh-wait", type=float, default=60.0)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override for every gossip worker (p2p.mesh_degree=4)")
    ap.add_argument("--slow-start-after-idle", type=int, choices=[0, 1],
                    help="gossip: set net.ipv4.tcp_slow_start_after_idle in every worker's "
                         "namespace (Linux default 1: an idle TCP connection restarts from "
                         "its initial window, so each body on an idle link pays ~2 RTTs more)")
    ap.add_argument("--congestion-control", choices=["bbr", "cubic", "reno"],
                    help="gossip, broadcast: set net.ipv4.tcp_congestion_control in every "
                         "host's "
                         "namespace (the lab's hosts inherit this machine's, bbr here; most "
                         "operators' kernels default to cubic: RESULTS tcp-tail)")
    # broadcast
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--skip-shardcast", action="store_true")
    ap.add_argument("--peer-set", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override for every broadcast peer of ours "
                         "(broadcast.max_uploads_total=8)")
    ap.add_argument("--half-timeout", type=float, default=900.0,
                    help="seconds each half (ours, shardcast) may take from its publish "
                         "command; then it is recorded as not finished")
    ap.add_argument("--lab-prefix", default="wanb",
                    help="netns name prefix of every section's labs (<= 8 chars)")
    # the gossip worker (run by the benchmark inside lab hosts)
    ap.add_argument("--worker", choices=["gossip"])
    ap.add_argument("--timeline", type=Path,
                    help="print where each peer's start went, from a swarm run's node logs "
                         "(WORKDIR/swarmN), and exit")
    ap.add_argument("--listen")
    ap.add_argument("--bootstrap", action="append", default=[])
    ap.add_argument("--peers", type=int)
    ap.add_argument("--relay", action="store_true")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    if args.worker == "gossip":
        gossip_worker(args)
        return 0
    if args.timeline:
        print(timeline_table(args.timeline))
        return 0
    from swarm_node.node.testing.netlab import unavailable_reason

    reason = unavailable_reason()
    if reason:
        print(f"benchmarks/wan.py: {reason}", file=sys.stderr)
        return 2
    args.load_before = load_avg()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="wan-bench-"))
    print(f"workdir {work} (logs of every process); load {args.load_before}", flush=True)
    model_dir = work / "model"
    if {"pair", "swarm", "scaling"} & set(args.sections):
        from swarm_node.node.models import build_tiny_model

        if not (model_dir / "config.json").exists():
            build_tiny_model(model_dir, seed=0)
    runs = {"stage": lambda: section_stage(args, work),
            "pair": lambda: section_pair(args, work, model_dir),
            "swarm": lambda: section_swarm(args, work, model_dir),
            "gossip": lambda: section_gossip(args, work),
            "broadcast": lambda: section_broadcast(args, work),
            "scaling": lambda: section_scaling(args, work, model_dir)}
    figures = {}
    for name in args.sections:
        t0 = time.monotonic()
        with LoadSampler() as loads:
            body, figures[name] = runs[name]()
        body += (f"\n\nSection wall time {time.monotonic() - t0:.0f} s; load after {load_avg()}; "
                 f"1-min load during the section {loads.summary()}.")
        print(f"\n## wan: {name}\n\n{body}\n", flush=True)
        if not args.no_record:
            record(f"wan: {name}", body, headline=headlines(name, figures[name], args))
        if args.json:
            args.json.write_text(json.dumps(figures, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
