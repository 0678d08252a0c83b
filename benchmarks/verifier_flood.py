"""A sybil flood on a trainer's verification (issue #30 item 4), measured end to end.

    .venv/bin/python benchmarks/verifier_flood.py [--window-s 15] [--cycles 6] [--rate 50]
        [--control] [--garbage] [--lr 1e-12]

Real `swarm-node join` processes on loopback (tiny model): a trainer and an honest inference
peer (established before the flood), and in this process the flood (node/testing/flood.py):
bogus batches that pass every check before the model runs, each signed by a fresh key,
over 4 connections replaced when cut, at most `--rate` batches per second in all.

The honest baseline must hold still for the ratio to mean anything: with learning on, the
tiny model soon solves the toy task, its groups lose their reward signal, the trainer
waits `peer_wait_s` for groups with signal and the peer waits for new versions, and the
honest rate fell 180 -> 22 -> 9 completions/s over 6 min. So the trainer's learning rate
is ~0 (`--lr`; the policy stays put, every step and version still happens), and windows
of `--window-s` alternate, each flood window between two baseline windows of the same
length:

  baseline   nothing but the swarm;
  control    (`--control`) the attacker does all its work (keys, batches, signatures) but
             sends nothing: what its CPU alone takes from the 2 shared cores;
  flood      the same, sent;

`--cycles` times, then a last baseline. Per window, from the nodes' /status sampled every
second: what the honest peer offered (completions sent) and what the trainer accepted of
it, trainer versions, the trainer's CPU, what the trainer spent verifying the flood (its
intake's probation seconds). Honest share of a flood window = its honest acceptance / the
mean of the baseline windows just before and after it. Recovery: from the flood's end to
the first `--recovery-window-s` stretch back at >= 80% of that baseline. The machine is
shared: the load average is recorded.

`--newcomer N` (section verifier-flood-newcomer) replaces the windows by N trials,
alternately with and without the flood (`--flood-first`; `--connections` carriers): in each,
an honest NEWCOMER (a fresh `swarm-node join`, a fresh key) joins `--lead-s` after the
flood starts; its first publish -> first accepted batch and its first `--minute-s` of
acceptance, from the nodes' logs, and the attacker's CPU and keys against the trainer's
verification of bogus batches (`newcomer_trial`, `newcomer_costs`).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

BIN = Path(sys.executable).parent / "swarm-node"
SWARM = "floodbench"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    def __init__(self, root: Path, cfg: dict, prefix: list[str] | None = None,
                 env: dict | None = None):
        """`swarm-node join` with `cfg` in `root`; `prefix`: the command that runs instead
        of the `swarm-node` executable (given the same arguments), `env`: added to it."""
        from swarm_node.node.config import dump_toml

        self.root, self.cfg = root, cfg
        root.mkdir(parents=True, exist_ok=True)
        (root / "node.toml").write_text(dump_toml(cfg))
        env = {**os.environ, "HOME": str(root), "OMP_NUM_THREADS": "1",
               "PYTHONUNBUFFERED": "1", **(env or {})}
        self.log = root / "node.log"
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen([*(prefix or [str(BIN)]), "join", "--config",
                                          str(root / "node.toml")],
                                         stdout=log, stderr=subprocess.STDOUT, env=env)

    def status(self) -> dict:
        try:
            with urllib.request.urlopen(
                    f"http://127.0.0.1:{self.cfg['admin']['port']}/status", timeout=5) as r:
                return json.loads(r.read())
        except OSError:
            return {}

    def wait(self, pred, timeout: float, what: str):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{what}: exited\n{self.log.read_text()[-2000:]}")
            got = pred()
            if got:
                return got
            time.sleep(0.5)
        raise RuntimeError(f"timed out: {what}\n{self.log.read_text()[-2000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class Sample(NamedTuple):
    """One reading of the trainer's and the honest peer's /status."""

    t: float  # monotonic
    accepted: int  # honest completions the trainer accepted so far
    rejected: int  # ... and rejected
    offered: int  # completions the honest peer sent so far
    version: int  # the trainer's policy version
    intake: dict  # the trainer's intake view (extra.intake)
    cpu: float  # the trainer process's CPU seconds so far
    peer_cpu: float  # the honest peer's
    waited: float  # seconds the trainer's and the peer's threads were ready but not running


def configs(root: Path, model_dir: Path, lr: float) -> tuple[dict, dict]:
    shared = {"tasks": {"mix": {"toy/digit_successor": 1.0}, "tasks_per_round": 4},
              "sampler": {"completions_per_task": 4, "max_new_tokens": 8,
                          "batches_per_version": 2}}
    trainer = {"node": {"role": "trainer", "swarm_id": SWARM, "data_dir": str(root / "t"),
                        "listen": ["/ip4/127.0.0.1/tcp/0"]},
               "model": {"name": str(model_dir)}, "admin": {"port": free_port()},
               **shared, "trainer": {"learning_rate": lr, "local_items": 4, "external_items": 0,
                                     "peer_batches_per_step": 2, "peer_wait_s": 5.0}}
    peer = {"node": {"role": "inference", "swarm_id": SWARM, "data_dir": str(root / "p"),
                     "listen": ["/ip4/127.0.0.1/tcp/0"]},
            "model": {"name": str(model_dir)}, "admin": {"port": free_port()},
            "tasks": shared["tasks"], "sampler": {**shared["sampler"], "version_wait_s": 5.0}}
    return trainer, peer


async def run(args) -> dict:
    from swarm_node.node.config import Config
    from swarm_node.node.identity import Identity
    from swarm_node.node.models import build_tiny_model, load_model
    from swarm_node.node.sampler.factory import sampling_params
    from swarm_node.node.tasks import TaskSource
    from swarm_node.node.testing import attacks
    from swarm_node.node.testing.flood import GarbageFlood, SybilFlood
    from swarm_node.verifier.rules import batch_rules

    root = Path(args.workdir)
    model_dir = build_tiny_model(root / "model")
    tcfg, pcfg = configs(root, model_dir, args.lr)
    trainer = Proc(root / "trainer", tcfg)
    peer = None
    try:
        trainer.wait(lambda: "joined swarm" in trainer.log.read_text(), 180, "trainer joined")
        tid = trainer.wait(lambda: trainer.status().get("peer_id"), 60, "trainer status")
        boot = json.loads((Path(tcfg["node"]["data_dir"]) / "node.json").read_text())[
            "listen_addrs"][0]
        pcfg["node"].update(bootstrap=[boot], follow=[tid])
        peer = Proc(root / "peer", pcfg)
        hid = peer.wait(lambda: peer.status().get("peer_id"), 180, "peer up")

        def sample() -> Sample:
            st = trainer.status()
            acc = (st.get("accepted_by_peer") or {}).get(hid, {})
            return Sample(time.monotonic(), acc.get("accepted", 0), acc.get("rejected", 0),
                          peer.status().get("rollouts_sent", 0), st.get("policy_version", 0),
                          (st.get("extra") or {}).get("intake") or {},
                          process_cpu(trainer.proc.pid), process_cpu(peer.proc.pid),
                          run_queue_wait(trainer.proc.pid) + run_queue_wait(peer.proc.pid))

        trainer.wait(lambda: sample().accepted >= 64, 300, "honest peer established")
        swarm = Config.model_validate({"tasks": tcfg["tasks"], "sampler": tcfg["sampler"],
                                       "node": {"swarm_id": SWARM,
                                                "listen": ["/ip4/127.0.0.1/tcp/0"]}})
        model, tokenizer = load_model(model_dir)
        source = TaskSource(swarm.tasks.mix, SWARM)
        rules, params = batch_rules(swarm), sampling_params(swarm)
        rng = random.Random(0)
        version = [0]

        def make_batch(sender: str, v: int):
            return attacks.bogus_round(tokenizer, source, sender, round_=rules.round_for(v, 0),
                                       version=v, tasks=rules.tasks_per_round,
                                       n=rules.completions_per_task, params=params,
                                       hidden_size=model.config.hidden_size, rng=rng,
                                       policy_id=tid, swarm_id=SWARM,
                                       length=params.max_new_tokens)

        if args.subnets:
            flood_sources(args.subnets, args.connections)

        def new_flood():
            if args.garbage:  # garbage on every protocol, from fresh identities
                return GarbageFlood(swarm, boot, tid, connections=8, interval_s=8.0 / args.rate)
            return SybilFlood(swarm, boot, tid, make_batch, lambda: version[0],
                              connections=args.connections,
                              interval_s=args.connections / args.rate)

        async def window(name: str, kind: str) -> dict:
            """One window of `args.window_s`: `kind` baseline (nothing), control (the
            attacker's work, nothing sent) or flood; its samples, one a second."""
            stop = asyncio.Event()
            flood, task = None, None
            if kind == "flood":
                flood = new_flood()
                task = asyncio.ensure_future(flood.run(stop))
            spy = profile(args, trainer.proc.pid, name)
            wall = time.time()
            samples = [sample()]
            t_end = samples[0].t + args.window_s
            built = 0
            while time.monotonic() < t_end:
                if kind == "control" and not args.garbage:  # the attacker's work, not sent
                    t1 = min(t_end, time.monotonic() + 1.0)
                    while time.monotonic() < t1:
                        sybil = Identity.generate()
                        sybil.seal(make_batch(sybil.peer_id, version[0]))
                        built += 1
                        await asyncio.sleep(1.0 / args.rate)
                else:
                    await asyncio.sleep(max(0.0, min(1.0, t_end - time.monotonic())))
                samples.append(sample())
                version[0] = samples[-1].version
            stop.set()
            if task is not None:
                await task  # the attacker's connections are closed when this returns
            if spy is not None:
                spy.wait()
            return {"name": name, "kind": kind, "samples": samples, "built": built,
                    "ended": time.monotonic(), "flood": flood, "wall": (wall, time.time())}

        if args.newcomer:
            trials = []
            for i in range(args.newcomer):
                flooded = (i % 2 == 0) == args.flood_first
                trials.append(await newcomer_trial(args, i, flooded, root, pcfg, trainer,
                                                   new_flood, version))
            return {"trials": trials, "trainer_rss_mib": _rss(trainer.proc.pid)}

        # baseline, [control,] flood, ... , baseline: every flood (and control) window has a
        # baseline window of the same length just before and just after it
        cycle = ["baseline"] + (["control"] if args.control else []) + ["flood"]
        windows = []
        for i, kind in enumerate(cycle * args.cycles + ["baseline"]):
            windows.append(await window(f"{kind} {i // len(cycle) + 1}", kind))
        phases = honest_phases(trainer.log, peer.log, hid, [w["wall"] for w in windows])
        return {"windows": [{**summarize(w), **ph} for w, ph in zip(windows, phases)],
                "recovery_s": recoveries(windows, args.recovery_window_s),
                "flood": flood_totals([w["flood"] for w in windows if w["flood"] is not None]),
                "trainer_rss_mib": _rss(trainer.proc.pid)}
    finally:
        if peer is not None:
            peer.stop()
        trainer.stop()


def flood_sources(subnets: int, connections: int) -> list[str]:
    """Make the flood's carriers dial from `subnets` /24s: 127.N.0.x, N = 2 .. subnets + 1,
    round robin, `connections / subnets` hosts each (the trainer sees each carrier's
    source address, so its subnet: node/p2p/admission.py `subnet_of`). Patches the TCP
    transport's dial in THIS process (only the flood's carriers dial from here); the
    honest peers dial from 127.0.0.1, a subnet of their own. Returns the addresses."""
    from libp2p.transport.tcp import tcp

    hosts = max(1, -(-connections // subnets))
    sources = [f"127.{n}.0.{h}" for h in range(1, hosts + 1) for n in range(2, subnets + 2)]
    cycle = itertools.cycle(sources)
    real = tcp.trio

    class Sourced:
        def __getattr__(self, name):
            return getattr(real, name)

        @staticmethod
        async def open_tcp_stream(host, port, **kw):
            return await tcp._open_tcp_stream_from(host, port, (next(cycle), 0))

    tcp.trio = Sourced()
    return sources


class LogTail:
    """The lines a process's log gained since the last `new()` (a line ends in a newline)."""

    def __init__(self, path: Path):
        self.path, self.offset, self.rest = path, 0, b""

    def new(self) -> list[str]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                got = f.read()
        except OSError:
            return []
        self.offset += len(got)
        *lines, self.rest = (self.rest + got).split(b"\n")
        return [line.decode(errors="replace") for line in lines]


def log_time(line: str) -> float | None:
    """Seconds since the epoch of a node log line's timestamp (local time), or None."""
    import datetime

    try:
        return datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S.%f").timestamp()
    except ValueError:
        return None


PUBLISHED = re.compile(r"published round (\d+): (\d+) completions")
VERIFIED = re.compile(r"verified round (\d+) from (\S+): (\d+) accepted, (\d+) rejected"
                      r"(?: \(first: (\w+)\))?")


async def newcomer_trial(args, i: int, flooded: bool, root: Path, pcfg: dict, trainer: Proc,
                         new_flood, version: list[int]) -> dict:
    """One honest newcomer: a fresh `swarm-node join` (a fresh key, same settings as the
    established peer) started `args.lead_s` after a flood began (`flooded`), or with none;
    followed until its first accepted batch and its first `args.minute_s` of publishing
    (at most `args.newcomer_max_s` after its first publish). Times from the nodes' logs:
    the newcomer's `published round`, the trainer's `verified round ... from <it>`."""
    import copy

    stop = asyncio.Event()
    flood = task = None
    start = {"t": time.monotonic(), "intake": _intake(trainer),
             "cpu": process_cpu(trainer.proc.pid), "own_cpu": time.process_time()}
    if flooded:
        flood = new_flood()
        task = asyncio.ensure_future(flood.run(stop))
    tlog = LogTail(trainer.log)
    tlog.new()  # from now on
    await asyncio.sleep(args.lead_s)
    cfg = copy.deepcopy(pcfg)
    cfg["node"]["data_dir"] = str(root / f"newcomer-{i}" / "data")
    cfg["admin"] = {**cfg["admin"], "port": free_port()}
    new = Proc(root / f"newcomer-{i}", cfg)
    started = time.time()
    nlog = LogTail(new.log)
    nid, published, lines = None, [], []  # (wall time, round, completions); trainer's
    verified: list = []  # (wall time, round, accepted, rejected, first reason) of the newcomer
    try:
        while True:
            await asyncio.sleep(0.5)
            if new.proc.poll() is not None:
                raise RuntimeError(f"newcomer {i} exited\n{new.log.read_text()[-2000:]}")
            nid = nid or new.status().get("peer_id")
            version[0] = trainer.status().get("policy_version", version[0])
            for line in nlog.new():
                if (m := PUBLISHED.search(line)) and (t := log_time(line)) is not None:
                    published.append((t, int(m[1]), int(m[2])))
            lines += [line for line in tlog.new() if "verified round" in line]
            if nid:  # its lines, also those logged before its id was known here
                verified = [(t, int(m[1]), int(m[3]), int(m[4]), m[5] or "")
                            for line in lines if (m := VERIFIED.search(line))
                            and m[2] == nid[-8:] and (t := log_time(line)) is not None]
            now = time.time()
            if not published:
                if now - started > args.newcomer_start_s:
                    raise RuntimeError(f"newcomer {i} published nothing in "
                                       f"{args.newcomer_start_s:.0f} s")
                continue
            since = now - published[0][0]
            accepted = any(v[2] > 0 for v in verified)
            if since >= args.minute_s and (accepted or since >= args.newcomer_max_s):
                break
    finally:
        end = {"t": time.monotonic(), "intake": _intake(trainer),
               "cpu": process_cpu(trainer.proc.pid), "own_cpu": time.process_time()}
        stop.set()
        if task is not None:
            await task
        new.stop()
    return newcomer_figures(args, i, flooded, started, published, verified, start, end, flood)


def _intake(trainer: Proc) -> dict:
    return (trainer.status().get("extra") or {}).get("intake") or {}


def newcomer_figures(args, i, flooded, started, published, verified, start, end,
                     flood) -> dict:
    """A newcomer trial's figures (`newcomer_trial`)."""
    first_pub = published[0][0]
    first_acc = next((v for v in verified if v[2] > 0), None)
    minute = first_pub + args.minute_s
    before = [v for v in verified if first_acc is None or v[0] <= first_acc[0]]

    def intake(*keys) -> float:
        def get(view):
            for k in keys:
                view = (view or {}).get(k, 0)
            return view or 0
        return get(end["intake"]) - get(start["intake"])

    return {
        "trial": i + 1, "flood": flooded, "seconds": end["t"] - start["t"],
        "start_to_publish_s": first_pub - started,
        "publish_to_accept_s": None if first_acc is None else first_acc[0] - first_pub,
        "accept_round": None if first_acc is None else first_acc[1],
        # its batches published up to its first accept, and how many of them were verified
        "published_before_accept": sum(1 for p in published
                                       if first_acc is None or p[0] <= first_acc[0]),
        "verified_before_accept": len(before),
        "reasons_before_accept": sorted({v[4] for v in before if v[4]}),
        "minute_offered": sum(p[2] for p in published if p[0] <= minute),
        "minute_accepted": sum(v[2] for v in verified if v[0] <= minute),
        "minute_rejected": sum(v[3] for v in verified if v[0] <= minute),
        "probation_batches": intake("batches", "probation")
        + intake("batches", "probation_lent"),
        "probation_s": intake("verify_seconds", "probation"),
        "probation_lent_s": intake("verify_seconds", "probation_lent"),
        "dropped": sum(v - (start["intake"].get("dropped") or {}).get(k, 0)
                       for k, v in (end["intake"].get("dropped") or {}).items()),
        "trainer_cpu_s": end["cpu"] - start["cpu"],
        "bench_cpu_s": end["own_cpu"] - start["own_cpu"],
        "sent": flood.sent if flood else 0, "carriers": flood.carriers if flood else 0,
        "attacker_cpu_s": flood.cpu_s if flood else 0.0}


STEP = re.compile(r"train step -> v(\d+)")


def honest_phases(trainer_log: Path, peer_log: Path, honest: str,
                  walls: list[tuple[float, float]]) -> list[dict]:
    """Per window (wall start, end), from the nodes' logs, where the honest peer's batches
    spent their time: its batches published and verified in the window, publish -> verified
    (median, max ms), bogus batches the trainer verified while one of them waited (between
    its publish and its verification: count, and the longest such run), and the trainer's
    step cycle (median, max ms, from its `train step` lines)."""
    import statistics

    published: dict[int, float] = {}
    for line in peer_log.read_text(errors="replace").splitlines():
        if (m := PUBLISHED.search(line)) and (t := log_time(line)) is not None:
            published.setdefault(int(m[1]), t)
    verified: dict[int, float] = {}
    bogus: list[float] = []
    steps: list[float] = []
    for line in trainer_log.read_text(errors="replace").splitlines():
        if (m := VERIFIED.search(line)) and (t := log_time(line)) is not None:
            if m[2] == honest[-8:]:
                verified.setdefault(int(m[1]), t)
            else:
                bogus.append(t)
        elif STEP.search(line) and (t := log_time(line)) is not None:
            steps.append(t)
    out = []
    for a, b in walls:
        mine = [(published[r], verified.get(r)) for r in published if a <= published[r] < b]
        lat = [(v - p) * 1e3 for p, v in mine if v is not None]
        ahead = [sum(1 for x in bogus if p < x < v) for p, v in mine if v is not None]
        cyc = [(y - x) * 1e3 for x, y in itertools.pairwise(t for t in steps if a <= t < b)]
        out.append({"honest_published": len(mine), "honest_verified": len(lat),
                    "latency_ms": (statistics.median(lat), max(lat)) if lat else (0.0, 0.0),
                    "bogus_ahead": (sum(ahead), max(ahead, default=0)),
                    "cycle_ms": (statistics.median(cyc), max(cyc)) if cyc else (0.0, 0.0)})
    return out


def training_gap(samples: list[Sample]) -> float:
    """The longest time in a window's samples without a new trainer version (from the
    window's start, to its end)."""
    if len(samples) < 2:
        return 0.0
    gap, since = 0.0, samples[0].t
    for prev, cur in itertools.pairwise(samples):
        if cur.version > prev.version:
            gap, since = max(gap, cur.t - since), cur.t
    return max(gap, samples[-1].t - since)


def summarize(w: dict) -> dict:
    """A window's figures from its first and last samples."""
    a, b = w["samples"][0], w["samples"][-1]
    dt = max(b.t - a.t, 1e-9)

    def intake(*keys) -> float:
        def get(view):
            for k in keys:
                view = (view or {}).get(k, 0)
            return view or 0
        return get(b.intake) - get(a.intake)

    flood = w["flood"]
    return {"window": w["name"], "kind": w["kind"], "seconds": dt,
            "honest_per_s": (b.accepted - a.accepted) / dt,
            "offered_per_s": (b.offered - a.offered) / dt,
            "honest_rejected": b.rejected - a.rejected,
            "versions_per_s": (b.version - a.version) / dt, "trainer_cpu_s": b.cpu - a.cpu,
            "peer_cpu_s": b.peer_cpu - a.peer_cpu, "waited_s": b.waited - a.waited,
            "probation_batches": intake("batches", "probation"),
            "probation_s": intake("verify_seconds", "probation"),
            "probation_lent_s": intake("verify_seconds", "probation_lent"),
            "dropped": sum(v - (a.intake.get("dropped") or {}).get(k, 0)
                           for k, v in (b.intake.get("dropped") or {}).items()),
            "sent": (getattr(flood, "sent", 0) or getattr(flood, "streams", 0)) if flood else 0,
            "built": w["built"], "max_gap_s": training_gap(w["samples"])}


def neighbours(windows: list[dict], i: int) -> float | None:
    """The mean honest acceptance (completions/s) of the baseline windows just before and
    just after window i."""
    before = next((w for w in reversed(windows[:i]) if w["kind"] == "baseline"), None)
    after = next((w for w in windows[i + 1:] if w["kind"] == "baseline"), None)
    got = [w["honest_per_s"] for w in (before, after) if w is not None]
    return sum(got) / len(got) if got else None


def recoveries(windows: list[dict], span: float) -> list[float | None]:
    """Per flood window: seconds from the flood's end (its connections closed) until the
    first `span`-s stretch of the next window whose honest acceptance is >= 80% of the
    flood's baseline (`neighbours`); None if none within that window."""
    out = []
    summaries = [summarize(w) for w in windows]
    for i, w in enumerate(windows):
        if w["kind"] != "flood" or i + 1 >= len(windows):
            continue
        ref = neighbours(summaries, i) or 0.0
        after = windows[i + 1]["samples"]
        got = None
        for j, s in enumerate(after):
            k = next((k for k in range(j, len(after)) if after[k].t - s.t >= span), None)
            if k is None:
                break
            if (after[k].accepted - s.accepted) / (after[k].t - s.t) >= 0.8 * ref:
                got = max(0.0, s.t - w["ended"])
                break
        out.append(got)
    return out


def flood_totals(floods: list) -> dict:
    sent = sum(getattr(f, "sent", 0) or getattr(f, "streams", 0) for f in floods)
    return {"sent": sent, "carriers": sum(f.carriers for f in floods),
            "cut": sum(f.cut for f in floods),
            "attacker_ms": sum(getattr(f, "cpu_s", 0.0) for f in floods) / max(1, sent) * 1e3,
            "refused": sum(getattr(f, "refused", 0) for f in floods)}


def profile(args, pid: int, phase: str):
    """py-spy over the trainer process for the phase (`--profile DIR`: collapsed stacks per
    thread, DIR/<phase>.txt), or None."""
    if not args.profile:
        return None
    out = Path(args.profile) / f"{phase.replace(' ', '-')}.txt"
    out.parent.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen([args.py_spy, "record", "-p", str(pid), "-d",
                             str(max(1, int(args.window_s) - 2)), "-r", "50", "--threads", "--gil",
                             "-f", "raw", "-o", str(out), "--nonblocking"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def process_cpu(pid: int) -> float:
    """CPU seconds (user + system) of process `pid` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_queue_wait(pid: int) -> float:
    """Seconds the threads of process `pid` have spent so far ready to run but waiting for
    a core (/proc/PID/task/TID/schedstat, 2nd field): what other tenants' load took."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[1])
        except (OSError, IndexError, ValueError):
            continue
    return total / 1e9


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds so far of each thread of process `pid`, by thread id (the ids py-spy
    names in `--profile` output)."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[task.name] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return out


def _rss(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def shares(windows: list[dict], kind: str) -> list[float]:
    """Per window of `kind`: its honest acceptance / that of the baselines around it."""
    out = []
    for i, w in enumerate(windows):
        ref = neighbours(windows, i) if w["kind"] == kind else None
        if ref:
            out.append(w["honest_per_s"] / ref)
    return out


def report(res: dict, load: str, args) -> str:
    import statistics

    from benchmarks.results import table

    ws = res["windows"]
    rows = [[w["window"], f"{w['seconds']:.0f}", f"{w['offered_per_s']:.1f}",
             f"{w['honest_per_s']:.1f}", w["honest_rejected"], f"{w['versions_per_s']:.2f}",
             f"{w['trainer_cpu_s']:.1f}", f"{w['peer_cpu_s']:.1f}", f"{w['waited_s']:.1f}",
             w["sent"], w["probation_batches"],
             f"{w['probation_s']:.1f} + {w['probation_lent_s']:.1f}", w["dropped"],
             f"{w['max_gap_s']:.1f}"] for w in ws]
    flood, control = shares(ws, "flood") or [0.0], shares(ws, "control")
    f = res["flood"]
    fl = [w for w in ws if w["kind"] == "flood"]
    verified = sum(w["probation_batches"] for w in fl)
    spent = sum(w["probation_s"] + w["probation_lent_s"] for w in fl)
    seconds = sum(w["seconds"] for w in fl)
    rec = res["recovery_s"]
    pct = ", ".join(f"{x:.0%}" for x in flood)
    lr = (f"trainer learning rate {args.lr:g} (the policy stays put, so the honest peer's "
          "reward signal, and with it the trainer's and the peer's pacing, is the same in "
          "every window; with learning the baseline drifted 180 -> 9 completions/s in 6 min)")
    text = [(f"Load average: {load} (2 shared cores). Tiny model; {lr}; trainer "
             "`peer_batches_per_step = 2`, `peer_wait_s = 5`; honest peer: 4 tasks x 4 "
             "completions x 8 tokens, 2 rounds per version. "
             + (f"Flood: garbage (1-4096 random bytes per stream) on every protocol the "
                f"trainer serves, at most {args.rate:.0f} streams/s over 8 connections, each "
                "from a fresh identity, replaced when cut. " if args.garbage else
                f"Flood: at most {args.rate:.0f} bogus batches/s (they pass every check "
                f"before the model runs) over {args.connections} connections, a fresh key per "
                "batch. ")
             + f"Windows of {args.window_s:.0f} s: {args.cycles} x (baseline"
             + (", control (the attacker's CPU work, nothing sent)" if args.control else "")
             + ", flood), then a last baseline.\n"),
            ("**Honest share** of a flood window = the honest completions the trainer "
             "accepted per second in it / the mean of the same in the baseline windows just "
             "before and just after it (same length, same pacing; a drift of the machine or "
             "of the swarm moves both). 'offered' is what the honest peer sent "
             "(its `rollouts_sent`), 'accepted' what the trainer accepted of it "
             "(`accepted_by_peer`).\n"),
            table(["window", "s", "honest offered / s", "honest accepted / s",
                   "honest rejected", "trainer versions / s", "trainer CPU s", "peer CPU s",
                   "trainer + peer s waiting for a core",
                   "flood batches sent", "flood batches verified",
                   "verification s on them (share + lent)", "flood dropped unverified",
                   "longest gap without a version, s"], rows),
            "",
            ("Where the honest batches' time went, per window (from the nodes' logs: the "
             "peer's `published round`, the trainer's `verified round` and `train step` "
             "lines):\n"),
            table(["window", "honest batches published / verified",
                   "publish -> verified, ms (median, max)",
                   "bogus batches verified while one waited (summed over them, most for one)",
                   "trainer step cycle, ms (median, max)"],
                  [[w["window"], f"{w['honest_published']} / {w['honest_verified']}",
                    _pair(w["latency_ms"]), _pair(w["bogus_ahead"]), _pair(w["cycle_ms"])]
                   for w in ws]),
            "",
            (f"- honest share during the flood, per window: {pct}; **median "
             f"{statistics.median(flood):.0%}, lowest {min(flood):.0%}**"
             + (f"; control windows (the attacker's CPU alone): median "
                f"{statistics.median(control):.0%}" if control else "") + "."),
            ("- recovery (first " + f"{args.recovery_window_s:.0f}-s stretch after a flood at "
             ">= 80% of its baseline), seconds after the flood's connections closed: "
             + ", ".join("not within the next window" if r is None else f"{r:.1f}"
                         for r in rec) + "."),
            *([(f"- garbage: {f['sent']} streams opened over {f['carriers']} carriers "
                f"({f['cut']} cut), {f['refused']} opens or writes refused.")]
              if args.garbage else [
            (f"- flood: {f['sent']} bogus batches sent over {f['carriers']} carriers "
             f"({f['cut']} cut); {verified} reached the model checks "
             f"({verified / max(1, f['sent']):.1%}), in {spent:.1f} s of the flood windows' "
             f"{seconds:.0f} s ({spent / max(seconds, 1e-9):.0%}, idle time lent included)."),
            (f"- cost per bogus batch: attacker {f['attacker_ms']:.1f} ms CPU (a key, a "
             f"batch, two signatures); trainer {spent / max(1, verified) * 1e3:.0f} ms of "
             f"verification for each one it verified, {spent / max(1, f['sent']) * 1e3:.1f} "
             "ms per batch sent.")]),
            f"- trainer RSS at the end: {res['trainer_rss_mib']:.0f} MiB"]
    return "\n".join(text)


def _pair(xs) -> str:
    return ", ".join(f"{x:.0f}" for x in xs)


def newcomer_costs(trials: list[dict]) -> dict:
    """What the flood trials cost the attacker and the trainer. The trainer's verification
    of bogus batches: its probation seconds (share + lent) in a flood trial less what the
    newcomer's own probation batches took there (their count times the mean cost of one in
    the flood-free trials, where only the newcomer is on probation)."""
    calm = [t for t in trials if not t["flood"]]
    flood = [t for t in trials if t["flood"]]
    calm_batches = sum(t["probation_batches"] for t in calm)
    honest_batch_s = (sum(t["probation_s"] + t["probation_lent_s"] for t in calm)
                      / calm_batches) if calm_batches else 0.0
    bogus_s = sum(max(0.0, t["probation_s"] + t["probation_lent_s"]
                      - t["verified_before_accept"] * honest_batch_s) for t in flood)
    bogus_verified = sum(max(0, t["probation_batches"] - t["verified_before_accept"])
                         for t in flood)
    sent = sum(t["sent"] for t in flood)
    seconds = sum(t["seconds"] for t in flood)

    def per_s(ts, key):
        return sum(t[key] for t in ts) / max(1e-9, sum(t["seconds"] for t in ts))

    return {"sent": sent, "identities": sent + sum(t["carriers"] for t in flood),
            "attacker_ms": sum(t["attacker_cpu_s"] for t in flood) / max(1, sent) * 1e3,
            "attacker_cpu_s": sum(t["attacker_cpu_s"] for t in flood),
            "bench_cpu_per_s": (per_s(flood, "bench_cpu_s"), per_s(calm, "bench_cpu_s")),
            "trainer_cpu_per_s": (per_s(flood, "trainer_cpu_s"), per_s(calm, "trainer_cpu_s")),
            "honest_batch_ms": honest_batch_s * 1e3, "bogus_s": bogus_s,
            "bogus_verified": bogus_verified, "flood_seconds": seconds,
            "bogus_ms_per_verified": bogus_s / max(1, bogus_verified) * 1e3,
            "bogus_ms_per_sent": bogus_s / max(1, sent) * 1e3}


def report_newcomer(res: dict, load: str, args) -> str:
    import statistics

    from benchmarks.results import table

    trials = res["trials"]
    rows = [[t["trial"], "flood" if t["flood"] else "none", f"{t['seconds']:.0f}",
             f"{t['start_to_publish_s']:.1f}",
             "**not accepted**" if t["publish_to_accept_s"] is None
             else f"**{t['publish_to_accept_s']:.1f}**",
             f"{t['published_before_accept']} / {t['verified_before_accept']}"
             + (f" ({', '.join(t['reasons_before_accept'])})" if t["reasons_before_accept"]
                else ""),
             f"{t['minute_offered']} / {t['minute_accepted']} / {t['minute_rejected']}",
             f"{t['minute_accepted'] / args.minute_s:.1f}",
             f"{t['sent']} ({t['sent'] + t['carriers']})",
             f"{t['probation_batches']} ({t['probation_s']:.1f} + {t['probation_lent_s']:.1f} s)",
             t["dropped"], f"{t['trainer_cpu_s']:.1f}",
             f"{t['attacker_cpu_s'] / max(1, t['sent']) * 1e3:.1f}" if t["flood"] else "-"]
            for t in trials]
    c = newcomer_costs(trials)

    def delays(flooded: bool) -> str:
        got = [t["publish_to_accept_s"] for t in trials if t["flood"] == flooded]
        ok = [x for x in got if x is not None]
        text = ", ".join("none" if x is None else f"{x:.1f}" for x in got)
        return (f"{text} s (median {statistics.median(ok):.1f} s)" if ok else
                f"none accepted in {len(got)} trial(s)")

    def rate(flooded: bool) -> str:
        got = [t["minute_accepted"] / args.minute_s for t in trials if t["flood"] == flooded]
        return ", ".join(f"{x:.1f}" for x in got) or "-"

    text = [(f"Load average: {load} (2 shared cores). The same swarm as `verifier-flood` "
             "(tiny model, trainer learning rate 1e-12, an established honest peer); then "
             f"{len(trials)} trials, alternately with and without a flood "
             f"({'flood' if args.flood_first else 'none'} first): a NEWCOMER (a fresh "
             "`swarm-node join`, a fresh key, the honest peer's settings: 4 tasks x 4 "
             "completions x 8 tokens, 2 rounds per version) starts "
             f"{args.lead_s:.0f} s after the flood does (at most {args.rate:.0f} bogus "
             f"batches/s over {args.connections} connections"
             + (f" from {args.subnets} /24s (127.N.0.x; the newcomer on 127.0.0.1)"
                if args.subnets else "")
             + ", a fresh key per batch; it lasts "
             "the whole trial) "
             "or at the same point of a flood-free trial, and is followed until its first "
             f"accepted batch and its first {args.minute_s:.0f} s of publishing (at most "
             f"{args.newcomer_max_s:.0f} s). Times from the nodes' own log lines "
             "(the newcomer's `published round`, the trainer's `verified round ... from` it); "
             "one accepted batch (16 completions, >= 8 accepted) makes a sender established "
             "(NODE_SPEC 5.5), so its first accepted batch ends its probation.\n"),
            table(["trial", "flood", "s", "newcomer start -> first publish, s",
                   "first publish -> first accepted batch, s",
                   "its batches published / verified up to then (reasons)",
                   "first minute: completions offered / accepted / rejected",
                   "first minute: accepted / s", "flood batches sent (keys used)",
                   "probation batches verified (share + lent s)",
                   "dropped unverified", "trainer CPU s", "attacker CPU ms / batch"], rows),
            "",
            (f"- first publish -> first accepted batch: with the flood {delays(True)}; "
             f"without {delays(False)}."),
            (f"- accepted completions / s in its first minute: with the flood {rate(True)}; "
             f"without {rate(False)}."),
            (f"- the attacker: {c['sent']} bogus batches in {c['flood_seconds']:.0f} s of "
             f"flood trials, {c['identities']} identities (a key per batch, plus its "
             f"carriers'), {c['attacker_ms']:.1f} ms CPU per batch (a key, a batch, two "
             f"signatures: {c['attacker_cpu_s']:.1f} s in all); this process's whole CPU "
             f"(flood, transport and the benchmark's polling) {c['bench_cpu_per_s'][0]:.2f} "
             f"s/s with the flood, {c['bench_cpu_per_s'][1]:.2f} s/s without."),
            (f"- the trainer: {c['bogus_verified']} bogus batches verified, "
             f"{c['bogus_s']:.1f} s of verification on them "
             f"({c['bogus_ms_per_verified']:.0f} ms each verified, "
             f"{c['bogus_ms_per_sent']:.1f} ms per batch sent; the newcomer's own probation "
             f"batches, {c['honest_batch_ms']:.0f} ms each in the flood-free trials, "
             f"subtracted); its process CPU {c['trainer_cpu_per_s'][0]:.2f} s/s with the "
             f"flood, {c['trainer_cpu_per_s'][1]:.2f} s/s without."),
            f"- trainer RSS at the end: {res['trainer_rss_mib']:.0f} MiB"]
    return "\n".join(text)


def headline_newcomer(res: dict, load: str):
    """The verifier-flood-newcomer row of RESULTS.md's headline table from a run."""
    import statistics

    from benchmarks.results import Headline

    def med(flooded: bool) -> str:
        got = [t["publish_to_accept_s"] for t in res["trials"] if t["flood"] == flooded]
        ok = [x for x in got if x is not None]
        starved = len(got) - len(ok)
        return ((f"median {statistics.median(ok):.1f} s" if ok else "never")
                + (f", {starved} of {len(got)} not accepted" if starved else "")
                + f" ({len(got)} trials)")

    return Headline(
        figure="verifier: an honest newcomer's first accepted batch during a fresh-key flood "
               "(tiny model)",
        goal="accepted during the flood (not starved); delay measured",
        current=f"first publish -> first accepted batch: {med(True)}",
        baseline=f"no flood: {med(False)}",
        load=load.split(" -> ")[0].split(" / ")[0] + "-" + load.split(" -> ")[-1].split(" / ")[0])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--window-s", type=float, default=15.0)
    ap.add_argument("--cycles", type=int, default=6)
    ap.add_argument("--recovery-window-s", type=float, default=5.0)
    ap.add_argument("--control", action="store_true", help="a control window (the "
                    "attacker's CPU work, nothing sent) before each flood window")
    ap.add_argument("--lr", type=float, default=1e-12, help="the trainer's learning rate "
                    "(default: a policy that stays put, so the baseline is steady)")
    ap.add_argument("--rate", type=float, default=50.0)
    ap.add_argument("--connections", type=int, default=4, help="the sybil flood's carrier "
                    "connections (each introduces at most 2 new origins/s: "
                    "node/p2p/admission.py NEW_ORIGINS_PER_S)")
    ap.add_argument("--subnets", type=int, default=0, help="the flood's carriers dial from "
                    "this many /24s (127.N.0.x, N >= 2; the honest peers are on 127.0.0.1): "
                    "floods from many subnets; 0: all from 127.0.0.1")
    ap.add_argument("--workdir", default="/tmp/verifier-flood")
    ap.add_argument("--no-record", action="store_true")
    ap.add_argument("--garbage", action="store_true",
                    help="the flood is garbage on every protocol the trainer serves (issue 30 "
                    "item 13: 8 connections, fresh identities, --rate streams/s in all); "
                    "control = nothing sent; recorded as section verifier-garbage")
    ap.add_argument("--profile", default="", help="py-spy the trainer: collapsed stacks "
                    "per phase into this folder")
    ap.add_argument("--py-spy", default="py-spy", help="the py-spy executable")
    ap.add_argument("--newcomer", type=int, default=0, help="instead of the windows: this "
                    "many honest-newcomer trials, alternately with and without a flood "
                    "(recorded as section verifier-flood-newcomer)")
    ap.add_argument("--flood-first", action="store_true", help="the first newcomer trial "
                    "has the flood (default: the first has none)")
    ap.add_argument("--lead-s", type=float, default=8.0, help="the flood's head start over "
                    "the newcomer")
    ap.add_argument("--minute-s", type=float, default=60.0, help="the newcomer's first "
                    "stretch of publishing that is counted")
    ap.add_argument("--newcomer-max-s", type=float, default=120.0, help="how long after its "
                    "first publish a newcomer is waited for when not accepted yet")
    ap.add_argument("--newcomer-start-s", type=float, default=180.0)
    args = ap.parse_args()
    load = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    res = asyncio.run(run(args))
    load += " -> " + " / ".join(f"{x:.1f}" for x in os.getloadavg())
    text = report_newcomer(res, load, args) if args.newcomer else report(res, load, args)
    print(text)
    print(json.dumps(res, indent=1))
    if not args.no_record:
        from benchmarks.results import record

        if args.newcomer:
            record("verifier-flood-newcomer", text, headline=[headline_newcomer(res, load)])
        elif args.garbage:
            record("verifier-garbage", text)
        else:
            record("verifier-flood", text, headline=[headline(res, load)])


def headline(res: dict, load: str):
    """The verifier-flood row of RESULTS.md's headline table from a run."""
    import statistics

    from benchmarks.results import Headline

    share = shares(res["windows"], "flood") or [0.0]  # no baseline acceptance at all: 0
    rec = res["recovery_s"]
    back = [r for r in rec if r is not None]
    waited = [w["waited_s"] for w in res["windows"]]
    return Headline(
        figure="verifier: a fresh-key flood on a trainer's verification (tiny model)",
        goal=">= 80% of baseline honest acceptance; baseline within 10 s after",
        current=(f"median {statistics.median(share):.0%} of the baseline windows around each "
                 f"flood window (lowest {min(share):.0%}, {len(share)} windows); recovery "
                 + (f"{max(back):.1f} s at most" if back else "none")
                 + f" ({len(back)} of {len(rec)} within the next window); trainer + peer "
                 f"waited {min(waited):.0f}-{max(waited):.0f} s for a core per window"),
        baseline="before: trainer versions/s 0.23 -> 0.02 under the flood",
        load=load.split(" -> ")[0].split(" / ")[0] + "-" + load.split(" -> ")[-1].split(" / ")[0])


if __name__ == "__main__":
    main()
