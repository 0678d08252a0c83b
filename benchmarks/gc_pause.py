"""Collector pauses of every role, with and without `gc.freeze()` after start-up
(node/roles/base.py `freeze_heap`), measured with `gc.callbacks` in real processes.

    .venv/bin/python benchmarks/gc_pause.py [--seconds 60]

A trainer, an inference peer and a relay (`swarm-node join`, tiny model, loopback; the
trainer steps as fast as the peer's batches come, so the peer and the relay download a
new checkpoint every second or so) run `--seconds`, twice: with `gc.freeze` made a no-op
(before) and as shipped (after). Each process records every collection's duration by
generation (a callback at its start and its stop; counted from when all three are up, so
start-up's own collections are left out); at exit it also times one full
`gc.collect()` (what any full collection costs in that heap) and counts the objects the
collector tracks. The machine is shared: the load average is recorded.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.verifier_flood import SWARM, Proc, configs, free_port

# run in each node process in place of the `swarm-node` executable
PROBE = r"""
import atexit, gc, json, os, sys, time
pauses = {0: [], 1: [], 2: []}
started = [0.0]
def probe(phase, info):
    if phase == "start":
        started[0] = time.perf_counter()
    else:
        pauses[info["generation"]].append((time.time(), time.perf_counter() - started[0]))
gc.callbacks.append(probe)
if os.environ.get("GC_PAUSE_FREEZE") == "0":
    gc.freeze = lambda: None
def report():
    gc.callbacks.remove(probe)
    t = time.perf_counter()
    gc.collect()
    full = time.perf_counter() - t
    with open(os.environ["GC_PAUSE_OUT"], "w") as f:
        json.dump({"pauses": pauses, "full_collect_s": full, "frozen": gc.get_freeze_count(),
                   "tracked": len(gc.get_objects())}, f)
atexit.register(report)
sys.argv[0] = "swarm-node"
from swarm_node.cli.main import main
main()
"""


def one_run(root: Path, model_dir: Path, seconds: float, freeze: bool) -> dict:
    tcfg, pcfg = configs(root, model_dir, 1e-12)
    rcfg = {"node": {"role": "relay", "swarm_id": SWARM, "data_dir": str(root / "r"),
                     "listen": ["/ip4/127.0.0.1/tcp/0"]}, "admin": {"port": free_port()}}
    prefix = [sys.executable, "-c", PROBE]

    def env(role: str) -> dict:
        return {"GC_PAUSE_FREEZE": "1" if freeze else "0",
                "GC_PAUSE_OUT": str(root / f"{role}.gc.json")}

    procs = {"trainer": Proc(root / "trainer", tcfg, prefix, env("trainer"))}
    try:
        t = procs["trainer"]
        t.wait(lambda: "joined swarm" in t.log.read_text(), 180, "trainer joined")
        tid = t.wait(lambda: t.status().get("peer_id"), 60, "trainer status")
        boot = json.loads((Path(tcfg["node"]["data_dir"]) / "node.json").read_text())[
            "listen_addrs"][0]
        for role, cfg in (("inference", pcfg), ("relay", rcfg)):
            cfg["node"].update(bootstrap=[boot], follow=[tid])
            procs[role] = Proc(root / role, cfg, prefix, env(role))
        for role in ("inference", "relay"):  # started: a checkpoint of the trainer loaded
            p = procs[role]
            p.wait(lambda p=p: p.status().get("policy_version", 0) >= 1, 180, f"{role} up")
        t0, since = time.monotonic(), time.time()  # the steady part: all three are up
        v0 = t.status().get("policy_version", 0)
        while time.monotonic() - t0 < seconds:
            for role, p in procs.items():
                if p.proc.poll() is not None:
                    raise RuntimeError(f"{role} exited\n{p.log.read_text()[-2000:]}")
            time.sleep(1.0)
        versions = t.status().get("policy_version", 0) - v0
        until = time.time()
    finally:
        for p in procs.values():
            p.stop()
    out = {"versions": versions}
    for role in procs:
        stats = json.loads((root / f"{role}.gc.json").read_text())
        stats["pauses"] = {gen: [d for at, d in got if since <= at <= until]
                           for gen, got in stats["pauses"].items()}
        out[role] = stats
    return out


def summary(stats: dict) -> dict:
    full = stats["pauses"]["2"]
    young = stats["pauses"]["0"] + stats["pauses"]["1"]
    return {"full": len(full), "full_max_ms": max(full, default=0) * 1e3,
            "full_sum_ms": sum(full) * 1e3, "young": len(young),
            "young_max_ms": max(young, default=0) * 1e3,
            "collect_ms": stats["full_collect_s"] * 1e3, "tracked": stats["tracked"],
            "frozen": stats["frozen"]}


def report(runs: dict, load: str, seconds: float) -> str:
    from benchmarks.results import table

    rows = []
    for role in ("trainer", "inference", "relay"):
        for label in ("before", "after"):
            s = summary(runs[label][role])
            rows.append([role, label, s["full"], f"{s['full_max_ms']:.0f}",
                         f"{s['full_sum_ms']:.0f}", s["young"], f"{s['young_max_ms']:.1f}",
                         f"{s['collect_ms']:.0f}", s["tracked"], s["frozen"]])
    return "\n".join([
        (f"Load average: {load} (2 shared cores). Trainer + inference peer + relay, tiny model, "
        f"{seconds:.0f} s per run (collections counted over those seconds, from when the peer and the relay had loaded a checkpoint); before: `gc.freeze` a no-op ({runs['before']['versions']} "
        f"trainer versions), after: as shipped ({runs['after']['versions']} versions).\n"),
        table(["role", "run", "full collections", "longest (ms)", "all (ms)",
               "young collections", "longest young (ms)",
               "one full gc.collect() at exit (ms)", "objects tracked at exit",
               "objects frozen"], rows)])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--workdir", default="/tmp/gc-pause")
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()
    from swarm_node.node.models import build_tiny_model

    root = Path(args.workdir)
    model_dir = build_tiny_model(root / "model")
    load = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    runs = {label: one_run(root / label, model_dir, args.seconds, label == "after")
            for label in ("before", "after")}
    load += " -> " + " / ".join(f"{x:.1f}" for x in os.getloadavg())
    text = report(runs, load, args.seconds)
    print(text)
    if not args.no_record:
        from benchmarks.results import record

        record("gc-pause", text)


if __name__ == "__main__":
    main()
