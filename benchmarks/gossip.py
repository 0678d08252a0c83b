"""Rollout sharing: our GossipSub layer vs. the hivemind DHT pattern of Gensyn RL Swarm.

N peers as separate processes on loopback. Every round (every --interval seconds) each peer
shares one rollout batch of --batch-kib KiB:
- libp2p: `P2PNode.publish("rollouts", RolloutBatch)`; receivers record arrival times.
- hivemind baseline (RL Swarm's pattern): `dht.store(key=round, subkey=peer, value=batch)`,
  then `dht.get(key)` polled by every peer until it holds every peer's batch. Runs in the
  separate venv .venv-bench (hivemind and libp2p cannot share a process).

Figures: delivery ratio, per-message latency p50/p95/max, aggregate delivered throughput,
per round the time until every peer holds every other peer's batch (p50/p95/max over rounds),
and CPU per message per hop: the process CPU time (user + system, psutil, the worker and its
children, e.g. hivemind's p2pd) of all workers from the start signal until each reports done,
divided by the batches delivered (one delivery = one message arriving at one more peer).
Process CPU time, unlike wall time, is not inflated by other jobs on the machine.

    .venv/bin/python benchmarks/gossip.py [--peers 8 --rounds 20 --interval 1.0] [--load 2]

`--load N` runs N CPU-burner processes (one busy core each, each ends on its own after
--load-max-s) beside both systems for the whole run, the same for ours and the baseline.

Baseline venv (hivemind cannot be imported next to libp2p; it is gitignored). Install the CPU
torch first (from local disk here), or pip pulls a multi-GB CUDA build as hivemind's dependency:
    python3 -m venv .venv-bench && .venv-bench/bin/pip install 'torch==2.13.0'
    .venv-bench/bin/pip install 'torch==2.13.0' 'hivemind==1.1.12' 'protobuf<7'
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH_PY = ROOT / ".venv-bench" / "bin" / "python"
LOAD_BEFORE = float("nan")


# Workers -----------------------------------------------------------------------------------

def emit(obj) -> None:
    print(json.dumps(obj), flush=True)


async def read_line() -> dict:
    line = await asyncio.to_thread(sys.stdin.readline)
    return json.loads(line) if line.strip() else {}


def make_batch(policy_id: str, round_: int, nbytes: int):
    import numpy as np
    from swarm_node.protocol.messages import (
        Completion,
        RolloutBatch,
        SamplingParams,
        TaskRef,
        TensorData,
    )

    n = max(1, (nbytes - 600) // 8)  # int32 ids + float32 logprobs per token
    rng = np.random.default_rng(round_)
    comp = Completion(task=TaskRef(dataset="toy/digit_successor", seed=round_, index=0),
                      prompt_ids=TensorData.from_numpy(np.arange(16, dtype=np.int32)),
                      completion_ids=TensorData.from_numpy(
                          rng.integers(0, 32000, n).astype(np.int32)),
                      logprobs=TensorData.from_numpy(-rng.random(n).astype(np.float32)),
                      finish_reason="length", seed=round_, claimed_reward=0.0)
    return RolloutBatch(swarm_id="bench", round=round_, policy_id=policy_id, policy_version=0,
                        sampling=SamplingParams(), completions=[comp])


def bench_config(args, **overrides):
    """The benchmark node's config: `--p2p FIELD=VALUE` items onto p2p (each value read as a
    TOML value, validated like the config file), plus `overrides` (dotted keys)."""
    from swarm_node.node.config import load_config, parse_set

    items = {f"p2p.{k}": v for k, v in parse_set(args.p2p).items()}
    return load_config(None, {"node.swarm_id": "bench",
                              "node.listen": ["/ip4/127.0.0.1/tcp/0"], **overrides, **items})


async def libp2p_worker(args) -> None:
    from swarm_node.node.identity import Identity
    from swarm_node.node.p2p import P2PNode

    cfg = bench_config(args, **{"p2p.discovery_interval_s": 1.0})
    node = P2PNode(Identity.generate(), cfg)
    records = []

    async def on_batch(env, peer):
        records.append([peer, env.message.round, time.time(), env.ts_ms / 1000,
                        len(env.payload)])

    await node.start(bootstrap=args.bootstrap)
    await node.subscribe("rollouts", on_batch)
    emit({"event": "ready", "peer_id": node.peer_id, "addrs": node.listen_addrs})
    n_others = args.peers - 1
    while not (len(node.gossip.topic_peers("rollouts")) >= n_others
               and len(node.gossip.mesh_peers("rollouts")) >= min(n_others, cfg.p2p.mesh_degree_low)):
        await asyncio.sleep(0.05)
    batches = [make_batch(node.peer_id, r, args.batch_kib * 1024) for r in range(args.rounds)]
    emit({"event": "meshed"})
    start = (await read_line())["start"]
    late = []
    for r in range(args.rounds):
        delay = start + r * args.interval - time.time()
        if delay > 0:
            await asyncio.sleep(delay)
        else:
            late.append(-delay)
        await node.publish("rollouts", batches[r])
    expected = n_others * args.rounds
    deadline = time.time() + args.drain
    while len(records) < expected and time.time() < deadline:
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.5)
    emit({"event": "done", "peer_id": node.peer_id, "records": records,
          "metrics": node.metrics.snapshot()["counters"], "late_publishes": len(late)})
    await read_line()  # orchestrator says when everyone is done
    await node.close()


def hivemind_worker(args) -> None:
    asyncio.run(hivemind_worker_async(args))


async def hivemind_worker_async(args) -> None:
    # hivemind.DHT (the process wrapper RL Swarm uses) fails here on 64 KiB values: its
    # multiprocessing pipe raises BlockingIOError (EAGAIN) in the DHT process. DHTNode is the
    # same DHT (same p2pd daemon, same RPCs) without that pipe.
    from hivemind.dht.node import DHTNode
    from hivemind.utils.timed_storage import get_dht_time

    node = await DHTNode.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                                initial_peers=args.bootstrap or None)
    me = str(node.peer_id)
    emit({"event": "ready", "peer_id": me,
          "addrs": [str(a) for a in await node.get_visible_maddrs()]})
    emit({"event": "meshed"})
    start = (await read_line())["start"]
    payload = os.urandom(args.batch_kib * 1024)
    complete = []  # [round, seconds after the round started, peers held]
    for r in range(args.rounds):
        t0 = start + r * args.interval
        delay = t0 - time.time()
        if delay > 0:
            await asyncio.sleep(delay)
        key = f"bench_round_{r}"
        await node.store(key, payload, expiration_time=get_dht_time() + 600, subkey=me)
        held = 0
        while time.time() < t0 + args.drain:
            got = await node.get(key, latest=True)
            held = len(got.value) if got is not None and isinstance(got.value, dict) else 0
            if held >= args.peers:
                break
            await asyncio.sleep(args.poll)
        complete.append([r, time.time() - t0, held])
    emit({"event": "done", "peer_id": me, "complete": complete})
    await read_line()
    await node.shutdown()


async def cpu_micro(args) -> dict:
    """One hop in one process: node A publishes N batches (paced) to node B; the process CPU
    time (both nodes: seal, publish, send, receive, validate, deliver) per message."""
    from swarm_node.node.identity import Identity
    from swarm_node.node.p2p import P2PNode

    def config():
        return bench_config(args)

    a = P2PNode(Identity.generate(), config())
    await a.start(bootstrap=[], discovery=False)
    b = P2PNode(Identity.generate(), config())
    await b.start(bootstrap=a.listen_addrs, discovery=False)
    got = []

    async def on_batch(env, peer):
        got.append(env)

    try:
        await a.subscribe("rollouts", on_batch)
        await b.subscribe("rollouts", on_batch)
        while b.peer_id not in a.gossip.mesh_peers("rollouts"):
            await asyncio.sleep(0.05)
        batches = [make_batch(a.peer_id, r, args.batch_kib * 1024)
                   for r in range(args.cpu_micro)]
        cpu0, t0 = time.process_time(), time.time()
        for m in batches:
            await a.publish("rollouts", m)
            await asyncio.sleep(0.004)  # paced: the cost per message, not a queue's
        while len(got) < len(batches):
            await asyncio.sleep(0.01)
        cpu = time.process_time() - cpu0
        counters = {k: v for k, v in b.metrics.snapshot()["counters"].items()
                    if k.startswith(("payload_", "rejected"))}
    finally:
        await a.close()
        await b.close()
    return {"messages": len(batches), "cpu_ms_per_msg_hop": cpu * 1000 / len(batches),
            "wall_s": time.time() - t0, "receiver_counters": counters}


# Orchestrator ------------------------------------------------------------------------------

class Burners:
    """N processes that each keep one core busy, bounded in time even if we die."""

    CODE = "import time\nend = time.time() + {secs}\nwhile time.time() < end:\n    pass\n"

    def __init__(self, n: int, max_s: float):
        self.procs = [subprocess.Popen([sys.executable, "-c", self.CODE.format(secs=max_s)])
                      for _ in range(n)]

    def stop(self) -> None:
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def tree_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process and its children so far."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root] + root.children(recursive=True)
    except psutil.Error:
        return float("nan")
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


class Proc:
    def __init__(self, python: str, kind: str, args, bootstrap: list[str]):
        cmd = [python, str(Path(__file__).resolve()), "--worker", kind,
               "--peers", str(args.peers), "--rounds", str(args.rounds),
               "--interval", str(args.interval), "--batch-kib", str(args.batch_kib),
               "--drain", str(args.drain), "--poll", str(args.poll)]
        for b in bootstrap:
            cmd += ["--bootstrap", b]
        for item in args.p2p:
            cmd += ["--p2p", item]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.DEVNULL, text=True, env=env, cwd=ROOT)

    def expect(self, event: str, timeout: float = 300) -> dict:
        deadline = time.time() + timeout
        while time.time() < deadline:
            line = self.p.stdout.readline()
            if not line:
                raise RuntimeError(f"worker exited (rc={self.p.poll()}) before {event!r}")
            if line.startswith("{"):
                msg = json.loads(line)
                if msg.get("event") == event:
                    return msg
        raise TimeoutError(event)

    def send(self, obj) -> None:
        self.p.stdin.write(json.dumps(obj) + "\n")
        self.p.stdin.flush()

    def stop(self) -> None:
        try:
            self.send({})
            self.p.stdin.close()
            self.p.wait(30)
        except (OSError, subprocess.TimeoutExpired):
            self.p.kill()
            self.p.wait()


def run_swarm(python: str, kind: str, args) -> list[dict]:
    first = Proc(python, kind, args, [])
    procs = [first]
    try:
        ready = first.expect("ready")
        procs += [Proc(python, kind, args, ready["addrs"][:1]) for _ in range(args.peers - 1)]
        for p in procs[1:]:
            p.expect("ready")
        for p in procs:
            p.expect("meshed")
        # The 2 s before the start are idle (meshed, batches built): their CPU is each
        # worker's idle rate (heartbeats, discovery), subtracted for the net per-hop cost.
        t_idle = time.time()
        start = t_idle + 2.0
        cpu_idle = [tree_cpu_s(p.p.pid) for p in procs]
        for p in procs:
            p.send({"start": start})
        time.sleep(max(0.0, start - time.time()))
        cpu0 = [tree_cpu_s(p.p.pid) for p in procs]
        results = []
        for p, ci, c0 in zip(procs, cpu_idle, cpu0):
            results.append(p.expect("done", timeout=args.rounds * args.interval + args.drain + 120))
            cpu = tree_cpu_s(p.p.pid) - c0
            idle_rate = (c0 - ci) / (start - t_idle)
            results[-1]["cpu_s"] = cpu
            results[-1]["cpu_net_s"] = cpu - idle_rate * (time.time() - start)
        for r in results:
            r["start"] = start
        return results
    finally:
        for p in procs:
            p.stop()


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q / 100 * (len(xs) - 1)))]


def summarize_libp2p(results: list[dict], args) -> dict:
    start = results[0]["start"]
    peers = [r["peer_id"] for r in results]
    expected = len(peers) * (len(peers) - 1) * args.rounds
    seen = set()
    latencies, nbytes, last = [], 0, start
    round_done: dict[int, dict[str, float]] = {}
    for r in results:
        for sender, rnd, t_recv, t_sent, size in r["records"]:
            key = (r["peer_id"], sender, rnd)
            if key in seen:
                continue
            seen.add(key)
            latencies.append(t_recv - t_sent)
            nbytes += size
            last = max(last, t_recv)
            per = round_done.setdefault(rnd, {})
            per[key[0]] = max(per.get(key[0], 0.0), t_recv - (start + rnd * args.interval))
    complete_rounds = []
    for rnd in range(args.rounds):
        got = sum(1 for (rcv, _, rr) in seen if rr == rnd)
        if got == len(peers) * (len(peers) - 1):
            complete_rounds.append(max(round_done[rnd].values()))
    metrics = [r["metrics"] for r in results]
    return {
        "delivered": len(seen), "expected": expected,
        "ratio": len(seen) / expected,
        "lat_p50": pct(latencies, 50), "lat_p95": pct(latencies, 95),
        "lat_max": max(latencies) if latencies else float("nan"),
        "throughput_mib_s": nbytes / max(1e-9, last - start) / 2**20,
        "round_p50": pct(complete_rounds, 50), "round_p95": pct(complete_rounds, 95),
        "round_max": max(complete_rounds) if complete_rounds else float("nan"),
        "rounds_complete": len(complete_rounds),
        "round_times": [round(t, 3) for t in complete_rounds],
        "drops": sum(v for m in metrics for k, v in m.items() if k.startswith("drop_")),
        "rejected": sum(m.get("rejected", 0) for m in metrics),
        "reject_reasons": {k.removeprefix("rejected."): sum(m.get(k, 0) for m in metrics)
                           for k in sorted({k for m in metrics for k in m
                                            if k.startswith("rejected.")})},
        "publish_waits": sum(m.get("publish_waits", 0) for m in metrics),
        # announced payloads no source served (counted, not a drop: the batch is missing)
        "pull_failed": sum(m.get("payload_fetch_failed", 0) for m in metrics),
        "copies_per_delivery": (sum(m.get("gossip_copies_in", 0) for m in metrics)
                                / max(1, sum(m.get("received", 0) for m in metrics))),
        "late_publishes": sum(r.get("late_publishes", 0) for r in results),
        "cpu_ms_per_msg_hop": cpu_per_delivery(results, len(seen)),
        "cpu_net_ms_per_msg_hop": cpu_per_delivery(results, len(seen), "cpu_net_s"),
    }


def cpu_per_delivery(results: list[dict], delivered: int, key: str = "cpu_s") -> float:
    cpu = sum(r.get(key, float("nan")) for r in results)
    return cpu * 1000 / delivered if delivered else float("nan")


def summarize_hivemind(results: list[dict], args) -> dict:
    rounds: dict[int, list[tuple[float, int]]] = {}
    for r in results:
        for rnd, secs, held in r["complete"]:
            rounds.setdefault(rnd, []).append((secs, held))
    complete = [max(s for s, _ in v) for v in rounds.values()
                if all(h >= args.peers for _, h in v)]
    held = sum(min(h, args.peers) - 1 for v in rounds.values() for _, h in v)
    expected = args.peers * (args.peers - 1) * args.rounds
    return {"ratio": held / expected, "delivered": held, "expected": expected,
            "round_p50": pct(complete, 50), "round_p95": pct(complete, 95),
            "round_max": max(complete) if complete else float("nan"),
            "rounds_complete": len(complete),
            "cpu_ms_per_msg_hop": cpu_per_delivery(results, held),
            "cpu_net_ms_per_msg_hop": cpu_per_delivery(results, held, "cpu_net_s")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peers", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--interval", type=float, default=1.0, help="seconds between rounds")
    ap.add_argument("--batch-kib", type=int, default=64)
    ap.add_argument("--drain", type=float, default=30.0, help="seconds to wait for stragglers")
    ap.add_argument("--poll", type=float, default=0.1, help="hivemind get() poll interval")
    ap.add_argument("--load", type=int, default=0,
                    help="CPU-burner processes beside both systems for the whole run")
    ap.add_argument("--load-max-s", type=float, default=1800.0,
                    help="each burner ends on its own after this many seconds")
    ap.add_argument("--cpu-micro", type=int, default=0, metavar="N",
                    help="only measure CPU per message per hop: 2 nodes in one process, N "
                         "messages; prints JSON, records nothing")
    ap.add_argument("--skip-baseline", action="store_true")
    ap.add_argument("--no-record", action="store_true")
    ap.add_argument("--section", default="gossip", help="RESULTS.md section to write")
    ap.add_argument("--worker", choices=["libp2p", "hivemind"])
    ap.add_argument("--bootstrap", action="append", default=[])
    ap.add_argument("--p2p", action="append", default=[], metavar="FIELD=VALUE",
                    help="override a p2p config field in the libp2p workers (repeatable)")
    args = ap.parse_args()
    if args.worker == "libp2p":
        asyncio.run(libp2p_worker(args))
        return
    if args.worker == "hivemind":
        hivemind_worker(args)
        return

    if args.cpu_micro:
        print(json.dumps({**asyncio.run(cpu_micro(args)), "batch_kib": args.batch_kib,
                          "load_1min": os.getloadavg()[0]}))
        return
    global LOAD_BEFORE
    LOAD_BEFORE = os.getloadavg()[0]
    burners = Burners(args.load, args.load_max_s)
    try:
        run_both(args)
    finally:
        burners.stop()


def run_both(args) -> None:
    print(f"libp2p: {args.peers} processes, {args.rounds} rounds of {args.batch_kib} KiB "
          f"per peer every {args.interval}s, {args.load} CPU burners", flush=True)
    ours = summarize_libp2p(run_swarm(sys.executable, "libp2p", args), args)
    print(json.dumps(ours, indent=1), flush=True)
    base, base_note = None, ""
    if args.skip_baseline:
        base_note = "baseline skipped (--skip-baseline)"
    elif not BENCH_PY.exists():
        base_note = f"baseline not run: {BENCH_PY} missing (see benchmarks/README or this file)"
    else:
        try:
            base = summarize_hivemind(run_swarm(str(BENCH_PY), "hivemind", args), args)
            print(json.dumps(base, indent=1), flush=True)
        except Exception as e:  # noqa: BLE001 - reported in the results, not hidden
            base_note = f"baseline failed: {type(e).__name__}: {e}"
    if base_note:
        print(base_note)
    if not args.no_record:
        record(args, ours, base, base_note)


def record(args, ours: dict, base: dict | None, note: str) -> None:
    sys.path.insert(0, str(ROOT))
    from benchmarks.results import record as write
    from benchmarks.results import table

    def ms(x):
        return "n/a" if math.isnan(x) else f"{x * 1000:.0f} ms"

    def cpu(x):
        return "n/a" if math.isnan(x) else f"{x:.1f} ms"

    delivery = f"{ours['ratio']:.2%} ({ours['delivered']}/{ours['expected']})"
    label = "libp2p GossipSub (ours" + (", overrides)" if args.p2p else ", default)")
    rows = [[label, delivery, ms(ours["lat_p50"]), ms(ours["lat_p95"]),
             ms(ours["lat_max"]), f"{ours['throughput_mib_s']:.2f} MiB/s",
             ms(ours["round_p50"]), ms(ours["round_p95"]), ms(ours["round_max"]),
             f"{ours['rounds_complete']}/{args.rounds}", cpu(ours["cpu_ms_per_msg_hop"]),
             cpu(ours["cpu_net_ms_per_msg_hop"])]]
    if base:
        rows.append(["hivemind DHT store+get (RL Swarm)",
                     f"{base['ratio']:.2%} ({base['delivered']}/{base['expected']})",
                     "-", "-", "-", "-", ms(base["round_p50"]), ms(base["round_p95"]),
                     ms(base["round_max"]), f"{base['rounds_complete']}/{args.rounds}",
                     cpu(base["cpu_ms_per_msg_hop"]), cpu(base["cpu_net_ms_per_msg_hop"])])
    body = (f"{args.peers} peers as separate processes on loopback; each shares one "
            f"{args.batch_kib} KiB rollout batch per round, one round every {args.interval}s, "
            f"{args.rounds} rounds, {args.load} CPU-burner processes beside both systems "
            "(--load). \"All held\" = time from round start until every peer holds every "
            "other peer's batch; CPU/msg/hop = process CPU of all workers (and their "
            "children) from the start signal to done, per delivered batch; \"net of idle\" "
            "subtracts each worker's idle CPU rate measured in the 2 s before the start.\n\n")
    body += table(["transport", "delivery", "lat p50", "lat p95", "lat max", "throughput",
                   "all held p50", "all held p95", "all held max", "rounds complete",
                   "CPU/msg/hop", "net of idle"], rows)
    reasons = ", ".join(f"{k} {v}" for k, v in ours["reject_reasons"].items())
    body += (f"\n\nlibp2p counters: drops {ours['drops']}, rejected {ours['rejected']}"
             + (f" ({reasons})" if reasons else "") + ", "
             f"publish waits {ours['publish_waits']}, late publishes {ours['late_publishes']}, "
             f"announced payloads pulled from no source {ours['pull_failed']}.")
    if ours["ratio"] < 1 and ours["drops"] == 0:
        body += (f" Messages missing from \"delivery\" had not arrived when the {args.drain:.0f}s "
                 "drain window after the last round closed (0 drops were counted: they were "
                 "still queued, not lost).")
    if base and not math.isnan(base["round_p95"]) and not math.isnan(ours["round_p95"]):
        ratio = ours["round_p95"] / base["round_p95"]
        goal = 0.3 if args.load == 0 else 0.5  # issue 13: quiet machine / with --load 2
        body += (f" p95 all-held time is {ratio:.2f}x the hivemind baseline's "
                 f"(goal: <= {goal}x): {'met' if ratio <= goal else 'NOT met'}.")
    body += f" hivemind get() polled every {args.poll}s."
    body += (f" Load average (1 min) before/after: {LOAD_BEFORE:.1f}/{os.getloadavg()[0]:.1f} "
             f"on {os.cpu_count()} cores"
             + (" (machine shared with other jobs)." if LOAD_BEFORE > 1.0 else
                " (no other jobs when it started; the load is this benchmark's own)."))
    if args.p2p:
        body += f" p2p overrides: {', '.join(args.p2p)}."
    if note:
        body += f"\n\n{note}"
    write(args.section, body, headline=headline(args, ours, base))


# the rows of RESULTS.md's headline table that a default run of this benchmark rewrites
HEADLINE_ROWS = {"gossip": ("gossip: round p95 vs hivemind (8 peers, 64 KiB, quiet)", 0.3),
                 "gossip-load2": ("gossip: round p95 vs hivemind, `--load 2`", 0.5)}


def headline(args, ours: dict, base: dict | None) -> list:
    from benchmarks.results import Headline

    row = HEADLINE_ROWS.get(args.section)
    if row is None or args.p2p or args.peers != 8 or not base:
        return []
    if math.isnan(base["round_p95"]) or math.isnan(ours["round_p95"]):
        return []
    figure, goal = row
    ratio = ours["round_p95"] / base["round_p95"]
    return [Headline(figure, f"<= {goal}x", f"{ratio:.2f}x ({ours['round_p95'] * 1000:.0f} ms)",
                     f"hivemind {base['round_p95'] * 1000:.0f} ms",
                     load=f"{LOAD_BEFORE:.1f}" + (f" + {args.load} burners" if args.load else ""))]


if __name__ == "__main__":
    main()
