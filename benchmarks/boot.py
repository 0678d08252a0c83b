"""One inference peer's start, launch to contribution (issue #27), this code against a baseline.

    .venv/bin/python benchmarks/boot.py --baseline-pythonpath DIR [--runs 3]
        [--silent-bootstrap] [--no-record]

A real trainer process (`swarm-node join --role trainer`, the tiny model, this code) runs
throughout as the bootstrap peer and the followed trainer. Then, `--runs` times, alternated
A/B, one inference peer (`swarm-node join --role inference`, a fresh data dir, a fresh `exec`
of the interpreter: every import counted) joins it, run from this checkout (A) and from
`--baseline-pythonpath DIR` (B: DIR/swarm_node is another copy of the code, e.g.
`git archive 0fe0efd | tar -x -C DIR/swarm_node`; the same interpreter and libraries). Each is
stopped after its first published rollout. Timed from the launch (wall s) with the peer
process's CPU s (user + system) at the same moment, read from /proc every 50 ms:
- node.json: written (host listening and joined through its bootstrap peers, admin up);
- running: it logs "joined swarm" (model loaded, role started: /status phase 'running');
- first rollout: it logs "published round" (its first batch gossiped).
`--silent-bootstrap` adds a second bootstrap address, a socket of this script that accepts
TCP connections and never answers: the bootstrap waits for that dial's timeout
(`p2p.dial_timeout_s`, 10 s), as a slow or dead bootstrap peer makes it wait (4-11 s per
dial in the WAN lab).
Printed and recorded (section "boot"): per run, and the medians per arm.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.results import Headline, record
from benchmarks.verifier_flood import Proc, free_port, process_cpu

SWARM = "bootbench"
FAKE_PEER = "12D3KooWNgpKH2Luu1kDmhJkc6dRcL7Q5n3mfKxpFDzk9oARbA2S"
MARKS = ("node.json", "running", "first rollout")


def shared(model_dir: Path) -> dict:
    return {"model": {"name": str(model_dir)},
            "tasks": {"mix": {"toy/digit_successor": 1.0}, "tasks_per_round": 4},
            "sampler": {"completions_per_task": 4, "max_new_tokens": 8}}


def boot_once(root: Path, model_dir: Path, bootstrap: list[str], trainer_id: str,
              pythonpath: str, timeout: float) -> dict:
    """Launch one inference peer; its wall and CPU s at each mark."""
    cfg = {"node": {"role": "inference", "swarm_id": SWARM, "data_dir": str(root / "data"),
                    "listen": ["/ip4/127.0.0.1/tcp/0"], "bootstrap": bootstrap,
                    "follow": [trainer_id]},
           "admin": {"port": free_port()}, **shared(model_dir)}
    env = {"PYTHONPATH": pythonpath} if pythonpath else None
    t0 = time.monotonic()
    peer = Proc(root, cfg, env=env)
    got: dict[str, tuple[float, float]] = {}
    try:
        while len(got) < len(MARKS):
            now = time.monotonic() - t0
            if peer.proc.poll() is not None:
                raise RuntimeError(f"the peer exited\n{peer.log.read_text()[-3000:]}")
            if now > timeout:
                raise RuntimeError(f"timed out, got {got}\n{peer.log.read_text()[-3000:]}")
            cpu = process_cpu(peer.proc.pid)
            text = peer.log.read_text()
            seen = {"node.json": (root / "data" / "node.json").exists(),
                    "running": "joined swarm" in text, "first rollout": "published round" in text}
            for mark in MARKS:
                if seen[mark] and mark not in got:
                    got[mark] = (round(now, 2), round(cpu, 2))
            time.sleep(0.05)
    finally:
        peer.stop()
    return got


def silent_listener() -> socket.socket:
    """A TCP socket that accepts (the kernel's backlog) and never answers."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(64)
    return s


def med(values: list[float]) -> float:
    return round(statistics.median(values), 2)


def run(args) -> dict:
    from swarm_node.node.models import build_tiny_model

    root = Path(args.workdir or tempfile.mkdtemp(prefix="bootbench-"))
    model_dir = build_tiny_model(root / "model")
    tcfg = {"node": {"role": "trainer", "swarm_id": SWARM, "data_dir": str(root / "t"),
                     "listen": ["/ip4/127.0.0.1/tcp/0"]},
            "admin": {"port": free_port()}, **shared(model_dir),
            "trainer": {"local_items": 4, "external_items": 0, "learning_rate": 1e-12}}
    trainer = Proc(root / "trainer", tcfg)
    silent = silent_listener() if args.silent_bootstrap else None
    arms = {"A": "", "B": args.baseline_pythonpath}
    runs: list[dict] = []
    loads = [os.getloadavg()[0]]
    try:
        trainer.wait(lambda: "joined swarm" in trainer.log.read_text(), 300, "trainer joined")
        info = json.loads((root / "t" / "node.json").read_text())
        bootstrap = [info["listen_addrs"][0]]
        if silent is not None:
            bootstrap.append(f"/ip4/127.0.0.1/tcp/{silent.getsockname()[1]}/p2p/{FAKE_PEER}")
        for i in range(args.runs):
            for arm in (("A", "B") if i % 2 == 0 else ("B", "A")):
                load = os.getloadavg()[0]
                got = boot_once(root / f"{arm}{i}", model_dir, bootstrap, info["peer_id"],
                                arms[arm], args.timeout)
                runs.append({"arm": arm, "run": i, "load": round(load, 1), **got})
                print(arm, i, f"load {load:.1f}", got, flush=True)
        loads.append(os.getloadavg()[0])
    finally:
        trainer.stop()
        if silent is not None:
            silent.close()
    return {"runs": runs, "loads": loads}


def summary(out: dict) -> dict:
    """Per arm and mark: median wall s and CPU s."""
    res: dict = {}
    for arm in ("A", "B"):
        rows = [r for r in out["runs"] if r["arm"] == arm]
        res[arm] = {m: (med([r[m][0] for r in rows]), med([r[m][1] for r in rows]))
                    for m in MARKS}
    return res


def report(args, out: dict) -> str:
    s = summary(out)
    head = ("| arm | run | load at launch | " + " | ".join(f"{m}: wall s / CPU s" for m in MARKS)
            + " |\n|---|---|---|" + "---|" * len(MARKS) + "\n")
    rows = [f"| {r['arm']} | {r['run']} | {r['load']} | "
            + " | ".join(f"{r[m][0]:.1f} / {r[m][1]:.1f}" for m in MARKS) + " |"
            for r in out["runs"]]
    meds = [f"| **{arm} median** | | | " + " | ".join(f"**{s[arm][m][0]:.1f} / {s[arm][m][1]:.1f}**"
                                                      for m in MARKS) + " |" for arm in ("A", "B")]
    what = ("one inference peer (tiny model, fresh `exec`, fresh data dir) joining a running "
            "trainer" + (" through two bootstrap addresses, the trainer's and a silent one "
                         "(accepts TCP, never answers: its dial waits out `p2p.dial_timeout_s`)"
                         if args.silent_bootstrap else ""))
    return (f"A: this code; B: `{args.baseline_pythonpath}` (the baseline). {what}; "
            f"{args.runs} runs per arm, alternated A/B. Load (1 min) at start / end: "
            f"{out['loads'][0]:.1f} / {out['loads'][-1]:.1f}.\n\n" + head + "\n".join(rows + meds))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline-pythonpath", required=True,
                    help="DIR holding DIR/swarm_node, the baseline copy of the code")
    ap.add_argument("--baseline-name", default="",
                    help="what the baseline is (a commit), for the record")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--silent-bootstrap", action="store_true")
    ap.add_argument("--timeout", type=float, default=240.0, help="per launch, s")
    ap.add_argument("--workdir", default="")
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # finally blocks stop the nodes
    out = run(args)
    body = report(args, out)
    print(body)
    if args.no_record:
        return
    s = summary(out)
    name = args.baseline_name or args.baseline_pythonpath
    section = "boot (silent bootstrap)" if args.silent_bootstrap else "boot"
    fig = ("boot: inference peer, launch to first published rollout"
           + (", one silent bootstrap address" if args.silent_bootstrap else ""))
    a, b = s["A"], s["B"]
    loads = f"{out['loads'][0]:.1f}-{out['loads'][-1]:.1f}"
    record(section, body, headline=[Headline(
        fig, "within 60 s on a loaded machine (issue #27)",
        f"{a['first rollout'][0]:.1f} s wall, {a['first rollout'][1]:.1f} CPU s (running at "
        f"{a['running'][0]:.1f} s / {a['running'][1]:.1f} CPU s); medians of {args.runs}",
        f"{name}: {b['first rollout'][0]:.1f} s, {b['first rollout'][1]:.1f} CPU s (running "
        f"{b['running'][0]:.1f} s / {b['running'][1]:.1f} CPU s)", load=loads)])


if __name__ == "__main__":
    main()
