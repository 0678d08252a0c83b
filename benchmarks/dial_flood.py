"""Fresh dials to a trainer during and after a many-identity flood (issue #30 item 2).

    .venv/bin/python benchmarks/dial_flood.py [--identities 20] [--rate 30]
        [--churn-s 1] [--baseline-s 10] [--flood-s 30] [--after-s 60] [--end close|kill]
        [--pin]

A real trainer process (`swarm-node join --role trainer`, tiny model, training on its own
samples at a learning rate of ~0 so that its pace, versions/s, holds still across phases);
a flood process (this script, `--flood-child`, running node/testing/flood.py's
VerdictFlood): `--identities` connections, each its own key, each publishing `--rate`
verdicts/s signed by itself (under the per-origin limit of 50/s) straight on its /meshsub
stream, each replaced by a fresh identity's after `--churn-s` (0: never), for
`--flood-s`; it then closes its connections (`--end close`) or is killed (`--end kill`:
the trainer learns of the end only from the kernel). In this process a prober: every
`--probe-every` seconds a FRESH identity (a new P2PNode, started without bootstrap) dials
the trainer (TCP, multistream, Noise, yamux: `connect`) and says hello (the peer exchange:
Hello out, the trainer's peer list back), each step timed, then closes; a probe is failed
when either step fails or takes over `--probe-timeout-s`. Phases: baseline, flood, after.
`--trainer-pythonpath DIR` runs the trainer from another copy of swarm_node (DIR/swarm_node,
e.g. one with a patch taken out) to compare the same flood. `--pin` (2 cores or more): the
trainer runs on core 0 alone (`taskset -c 0`), this process and the flood on core 1, so the
trainer's loss during the flood is what the flood costs the trainer itself, not a share of
the CPU the flooder took.
Printed: per phase, probes, failures, connect and hello p50/max, the trainer's policy
versions and versions/s (it must keep training) and its longest pause (no new version),
its own sampling rounds (one per iteration of its loop: verify, sample, step; a round
whose groups all lack reward signal, dropped as zero-advantage, makes no version), the
CPU seconds the trainer process used per second of the phase and those of the flood
process; the inbound connections the trainer refused at accept (`/metrics`
`connections_deferred_accept`, `connections_refused_accept`); the load average at start
and end; and the trainer's discovery state at the end of each phase (`/status`
`p2p.discovery`: peers known, redials started, peers forgotten after failed redials or
evicted from a full `known`; `p2p.peer_reach` entries; connections open) with its outbound
libp2p dials (`/metrics` `dials`, `dial_failures`), and when its last dial of the "after"
phase started (the flood's departed identities are redialled until forgotten).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.results import record
from benchmarks.verifier_flood import BIN, Proc, free_port


def p2p_config(**p2p):
    from swarm_node.node.config import load_config

    return load_config(None, {"node.listen": ["/ip4/127.0.0.1/tcp/0"],
                              **{f"p2p.{k}": v for k, v in p2p.items()}})


async def flood_child(args) -> None:
    """The flood process (node/testing/flood.py's VerdictFlood) until its stdin closes;
    prints one JSON line once every connection was opened ({"ready": n}), then its counts
    once a second and at the end."""
    from swarm_node.node.testing.flood import VerdictFlood

    flood = VerdictFlood(p2p_config(bootstrap_timeout_s=60), args.target_addr, args.target,
                         connections=args.identities, rate=args.rate,
                         churn_s=args.churn_s or None)
    stop = asyncio.Event()
    eof = asyncio.ensure_future(asyncio.to_thread(sys.stdin.read))
    eof.add_done_callback(lambda _: stop.set())
    running = asyncio.ensure_future(flood.run(stop))
    while flood.carriers < args.identities and not running.done():
        await asyncio.sleep(0.05)
    print(json.dumps({"ready": flood.carriers}), flush=True)

    def counts() -> str:
        return json.dumps({"sent": flood.sent, "connections": flood.carriers, "cut": flood.cut})

    while not running.done():
        print(counts(), flush=True)
        await asyncio.wait([running], timeout=1.0)
    await running
    print(counts(), flush=True)


async def probe(target: str, addr: str, timeout: float) -> dict:
    """One fresh identity: connect, then hello; each step's seconds, or the failure."""
    from swarm_node.node.identity import Identity
    from swarm_node.node.p2p import P2PNode

    node = P2PNode(Identity.generate(), p2p_config(dial_timeout_s=timeout))
    await node.start(bootstrap=[], discovery=False)
    out: dict = {"t": time.monotonic()}
    try:
        t0 = time.monotonic()
        try:
            await node.connect(addr, timeout=timeout)
        except Exception as e:  # noqa: BLE001 - the figure: a failed dial
            out["error"] = f"connect: {e}"[:200]
            return out
        out["connect_s"] = time.monotonic() - t0
        t1 = time.monotonic()
        learned = await node.discovery.exchange(target)
        hello_s = time.monotonic() - t1
        if target not in node.discovery.known and learned == 0:
            out["error"] = f"hello: no answer in {hello_s:.1f} s"
            return out
        out["hello_s"] = hello_s
        return out
    finally:
        await node.close()


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


async def run(args) -> dict:
    from swarm_node.node.models import build_tiny_model

    root = Path(args.workdir or tempfile.mkdtemp(prefix="dialflood-"))
    model_dir = build_tiny_model(root / "model")
    cfg = {"node": {"role": "trainer", "swarm_id": "default", "data_dir": str(root / "t"),
                    "listen": ["/ip4/127.0.0.1/tcp/0"]},
           "model": {"name": str(model_dir)}, "admin": {"port": free_port()},
           "tasks": {"mix": {"toy/digit_successor": 1.0}, "tasks_per_round": 4},
           "sampler": {"completions_per_task": 4, "max_new_tokens": 8},
           # learning rate ~0: the policy stays put, so versions/s is comparable across the
           # phases (with learning the toy task is soon solved and the pace drifts down)
           "trainer": {"local_items": 4, "external_items": 0, "learning_rate": 1e-12}}
    trainer = Proc(root / "trainer", cfg, env={"PYTHONPATH": args.trainer_pythonpath}
                   if args.trainer_pythonpath else None,
                   prefix=["taskset", "-c", "0", str(BIN)] if args.pin else None)
    child = None
    probes: list[dict] = []
    # phase, t, trainer policy version, own rounds, CPU s, zero-advantage groups dropped,
    # discovery state (discovery_state), the flood process's CPU s
    versions: list[tuple[str, float, int, int, float, int, dict, float]] = []
    phase = ["baseline"]
    stop = asyncio.Event()
    try:
        await asyncio.to_thread(trainer.wait, lambda: "joined swarm" in trainer.log.read_text(),
                                180, "trainer joined")
        info = json.loads((root / "t" / "node.json").read_text())
        tid, addr = info["peer_id"], info["listen_addrs"][0]

        async def prober() -> None:
            while not stop.is_set():
                start = time.monotonic()
                got = await probe(tid, addr, args.probe_timeout_s)
                got["phase"] = phase[0]
                probes.append(got)
                print(f"  probe [{got['phase']}] "
                      + (got.get("error") or f"connect {got['connect_s']:.2f} s, hello "
                         f"{got['hello_s']:.2f} s"), flush=True)
                await asyncio.sleep(max(0.0, args.probe_every - (time.monotonic() - start)))

        async def watcher() -> None:
            while not stop.is_set():
                st = await asyncio.to_thread(trainer.status)
                versions.append((phase[0], time.monotonic(), st.get("policy_version", -1),
                                 own_rounds(root / "t"), cpu_s(trainer.proc.pid),
                                 (st.get("buffer") or {}).get("dropped_zero_advantage", 0),
                                 await asyncio.to_thread(discovery_state, st, cfg),
                                 cpu_s(child.pid) if child is not None else 0.0))
                await asyncio.sleep(1.0)

        tasks = [asyncio.create_task(prober()), asyncio.create_task(watcher())]
        await asyncio.sleep(args.baseline_s)
        child = subprocess.Popen(  # noqa: ASYNC220 - its stdout is read in a thread
            [sys.executable, __file__, "--flood-child", "--target", tid, "--target-addr", addr,
             "--identities", str(args.identities), "--rate", str(args.rate),
             "--churn-s", str(args.churn_s)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            env=dict(os.environ, PYTHONUNBUFFERED="1"))
        ready = json.loads(await asyncio.to_thread(child.stdout.readline) or "{}")
        print(f"flood ready: {ready}", flush=True)
        phase[0] = "flood"
        t_flood = time.monotonic()
        last = ["{}"]

        def follow() -> None:
            for line in child.stdout:
                last[0] = line
        reader = asyncio.ensure_future(asyncio.to_thread(follow))
        await asyncio.sleep(args.flood_s)
        if args.end == "kill":  # the trainer learns of the end from the kernel alone
            child.send_signal(signal.SIGKILL)
        else:
            child.stdin.close()  # the flood closes its connections
        await asyncio.to_thread(child.wait)
        await reader
        end = json.loads(last[0])
        phase[0] = "after"
        t_after = time.monotonic()
        print(f"flood ended after {t_after - t_flood:.1f} s: {end}", flush=True)
        await asyncio.sleep(args.after_s)
        stop.set()
        await asyncio.gather(*tasks)
        return {"probes": probes, "versions": versions, "flood": {**ready, **end}}
    finally:
        stop.set()
        if child is not None and child.poll() is None:
            child.kill()
            child.wait()
        trainer.stop()


def discovery_state(st: dict, cfg: dict) -> dict:
    """The trainer's discovery figures now: /status p2p.discovery (absent on a tree without
    it), the number of p2p.peer_reach entries, open connections, and the /metrics
    counters of its outbound libp2p dials."""
    p2p = st.get("p2p") or {}
    out = {**(p2p.get("discovery") or {}), "peer_reach": len(p2p.get("peer_reach") or {}),
           "open": (p2p.get("connections") or {}).get("open", -1)}
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{cfg['admin']['port']}/metrics",
                                    timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return out
    for name in ("dials", "dial_failures", "connections_refused_accept",
                 "connections_deferred_accept"):
        m = re.search(rf'swarm_node_p2p_events_total\{{name="{name}"\}} (\S+)', text)
        out[name] = int(float(m.group(1))) if m else 0
    return out


def discovery_rows(versions: list[tuple]) -> str:
    """Per phase, the trainer's discovery state at its end, the dials started in it, and
    how long after the phase's start its last dial started."""
    rows = []
    keys = ("known", "peer_reach", "open", "redials", "forgotten", "evicted")
    for name in ("baseline", "flood", "after"):
        vs = [v for v in versions if v[0] == name and len(v) > 6 and "dials" in v[6]]
        if not vs:
            continue
        last, first = vs[-1][6], vs[0][6]
        prev = [v for v in versions if v[1] < vs[0][1] and len(v) > 6 and "dials" in v[6]]
        base = prev[-1][6] if prev else first
        dialled = [v for v, w in zip(vs, [prev[-1] if prev else vs[0]] + vs)
                   if v[6]["dials"] > w[6]["dials"]]
        last_dial = f"{dialled[-1][1] - vs[0][1]:.0f} s" if dialled else "none"
        rows.append(f"| {name} | " + " | ".join(str(last.get(k, "n/a")) for k in keys)
                    + f" | {last['dials'] - base['dials']} ({last['dial_failures'] - base['dial_failures']})"
                    + f" | {last_dial} |")
    if not rows:
        return ""
    return ("\n\nTrainer discovery at the end of each phase (n/a: not in /status on this tree):"
            "\n\n| phase | known | peer_reach | open | redials (all) | forgotten | evicted | "
            "dials in phase (failed) | last dial started at |\n|---|---|---|---|---|---|---|---|---|\n"
            + "\n".join(rows))


def own_rounds(data_dir: Path) -> int:
    """The trainer's own sampling rounds so far (its round.json)."""
    try:
        return json.loads((data_dir / "round.json").read_text())["next_round"]
    except (OSError, ValueError, KeyError):
        return 0


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system, all threads) process `pid` used so far."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def longest_pauses(versions: list[tuple]) -> dict[str, float]:
    """Per phase, the longest time the trainer's version stood still (seconds from one new
    version to the next, given to the phase in which it ended; one still open at the end
    counts to the last phase): the issue's "training paused 2.6-3.5 min"."""
    out: dict[str, float] = {}
    last_t, last_v = None, None
    for name, t, v, *_ in versions:
        if v < 0:  # /status did not answer: not a version
            continue
        if last_v is None or v > last_v:
            if last_t is not None:
                out[name] = max(out.get(name, 0.0), t - last_t)
            last_t, last_v = t, v
    if versions and last_t is not None:
        name, t, *_ = versions[-1]
        out[name] = max(out.get(name, 0.0), t - last_t)
    return out


WINDOW_S = 10.0


def windows(versions: list[tuple], width: float) -> dict[str, list[tuple[int, int]]]:
    """Per phase, the trainer's (new versions, own rounds) in each `width`-second window
    from the phase's start (a last partial window included)."""
    out: dict[str, list[tuple[int, int]]] = {}
    for name in dict.fromkeys(v[0] for v in versions):
        vs = [v for v in versions if v[0] == name and v[2] >= 0]
        if len(vs) < 2:
            continue
        ws, start = [], vs[0]
        for cur in vs[1:]:
            if cur[1] - start[1] >= width or cur is vs[-1]:
                ws.append((cur[2] - start[2], cur[3] - start[3]))
                start = cur
        out[name] = ws
    return out


def summarize(args, r: dict, loads: tuple[float, float]) -> str:
    rows = []
    pauses = longest_pauses(r["versions"])
    for name in ("baseline", "flood", "after"):
        ps = [p for p in r["probes"] if p["phase"] == name]
        ok = [p for p in ps if "error" not in p]
        conn = [p["connect_s"] for p in ok]
        hello = [p["hello_s"] for p in ok]
        vs = [v for v in r["versions"] if v[0] == name]
        dv = (vs[-1][2] - vs[0][2]) if len(vs) > 1 else 0
        dt = (vs[-1][1] - vs[0][1]) if len(vs) > 1 else 0
        rate = dv / dt if dt > 0 else float("nan")
        dr = (vs[-1][3] - vs[0][3]) if len(vs) > 1 else 0
        dz = (vs[-1][5] - vs[0][5]) if len(vs) > 1 else 0
        cpu = (vs[-1][4] - vs[0][4]) / dt if dt > 0 else float("nan")
        fcpu = (vs[-1][7] - vs[0][7]) / dt if dt > 0 and len(vs[0]) > 7 else float("nan")
        ref, dfr = ((vs[-1][6].get(k, 0) - vs[0][6].get(k, 0)) if len(vs) > 1 else 0
                    for k in ("connections_refused_accept", "connections_deferred_accept"))
        rows.append(f"| {name} | {len(ps)} | {len(ps) - len(ok)} | {pct(conn, 0.5):.2f} / "
                    f"{max(conn, default=float('nan')):.2f} | {pct(hello, 0.5):.2f} / "
                    f"{max(hello, default=float('nan')):.2f} | {dv} in {dt:.0f} s = "
                    f"{rate:.2f}/s | {pauses.get(name, 0.0):.0f} s | {dr} ({dz}) | "
                    f"{cpu:.2f} | {fcpu:.2f} | {dfr} / {ref} |")
    errors = sorted({p["error"][:80] for p in r["probes"] if "error" in p})
    series = windows(r["versions"], WINDOW_S)
    churn = f", each replaced by a fresh identity every {args.churn_s:g} s" if args.churn_s else ""
    trainer = f"trainer from {args.trainer_pythonpath}; " if args.trainer_pythonpath else ""
    trainer += "pinned: trainer core 0, flood and prober core 1; " if args.pin else ""
    return (f"{trainer}{args.identities} connections x {args.rate:g} verdicts/s for {args.flood_s:g} s"
            f"{churn}, flood end: {args.end}; probe every {args.probe_every:g} s (timeout "
            f"{args.probe_timeout_s:g} s); flood: {r['flood']}\n\n"
            "| phase | probes | failed | connect p50 / max s | hello p50 / max s | "
            "trainer versions | longest pause | own rounds (zero-advantage groups) | "
            "trainer CPU s/s | flood CPU s/s | waited / refused at accept |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|\n"
            + "\n".join(rows)
            + f"\n\nTrainer versions / own rounds per {WINDOW_S:g} s window (recovery): "
            + "; ".join(f"{name} " + " ".join(f"{v}/{n}" for v, n in ws)
                        for name, ws in series.items())
            + discovery_rows(r["versions"])
            + f"\n\nInbound connections the trainer accepted in all: "
              f"{r['flood'].get('connections', 0)} flood + {len(r['probes'])} probes "
              f"(py-libp2p's inbound slots: 250)."
            + f"\n\nErrors: {errors or 'none'}. Load (1 min) {loads[0]:.1f} at start, "
              f"{loads[1]:.1f} at end (2 shared cores).")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--identities", type=int, default=20)
    ap.add_argument("--rate", type=float, default=30.0, help="messages/s per identity")
    ap.add_argument("--baseline-s", type=float, default=10.0)
    ap.add_argument("--flood-s", type=float, default=30.0)
    ap.add_argument("--after-s", type=float, default=60.0)
    ap.add_argument("--end", default="close", choices=["close", "kill"])
    ap.add_argument("--churn-s", type=float, default=0.0,
                    help="replace each connection by a fresh identity's after this long")
    ap.add_argument("--probe-every", type=float, default=2.0)
    ap.add_argument("--probe-timeout-s", type=float, default=10.0)
    ap.add_argument("--workdir", default="")
    ap.add_argument("--trainer-pythonpath", default="",
                    help="run the trainer from another copy of swarm_node (DIR/swarm_node)")
    ap.add_argument("--pin", action="store_true",
                    help="trainer on core 0, this process and the flood on core 1")
    ap.add_argument("--section", default="dial-flood")
    ap.add_argument("--no-record", action="store_true")
    ap.add_argument("--flood-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--target", default="", help=argparse.SUPPRESS)
    ap.add_argument("--target-addr", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    from swarm_node.node.logs import setup_logging

    setup_logging("WARNING")
    if args.flood_child:
        asyncio.run(flood_child(args))
        return
    if args.pin:  # before any thread or child: all of them inherit it
        os.sched_setaffinity(0, {1})
    load0 = os.getloadavg()[0]
    result = asyncio.run(run(args))
    text = summarize(args, result, (load0, os.getloadavg()[0]))
    print(text)
    if not args.no_record:
        record(args.section, text)


if __name__ == "__main__":
    main()
