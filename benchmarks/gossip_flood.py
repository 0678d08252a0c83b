"""A many-identity gossip flood through an honest relay (issue #30 item 1): what the
victim still delivers of an honest origin's messages before, during and after the flood.

The victim is its own process (tests/node/p2p/peer_proc.py, a P2PNode that counts what it
receives per origin); in this process: an honest relay connected to the victim, an honest
origin connected to the relay, an observer connected to the victim (it only asks for the
victim's counts), and --identities sybil peers, each its own key and its own
connection to the relay, each publishing at --rate messages/s (under the per-peer limit of
50/s for verdicts and rollouts, 20/s for adverts; their sum far over it). The honest origin
publishes --honest-rate messages/s throughout. Phases of --phase seconds: baseline, flood,
after. Figures per phase: honest messages delivered at the victim per second and as a share
of the baseline, the victim's CPU (process user + system time / wall time), whether the
victim cut the relay; recovery = seconds from the flood's end until a 1 s window delivers
>= 95% of the baseline rate; attacker cost = CPU this process spent building (signing and
framing) the flood, per message, against the victim's CPU per flood message received.

    .venv/bin/python benchmarks/gossip_flood.py [--kind verdicts] [--identities 20]
        [--rate 10] [--phase 10] [--victim-pythonpath DIR] [--section NAME]

`--victim-pythonpath DIR` runs the victim from another copy of swarm_node (e.g. a checkout
of the code before a change, linked as DIR/swarm_node) to compare the same attack.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np
from swarm_node.node.config import Config, load_config
from swarm_node.node.identity import Identity
from swarm_node.node.logs import setup_logging
from swarm_node.node.p2p import P2PNode
from swarm_node.protocol.messages import ShardAdvert

from benchmarks.results import record
from tests.node.p2p.attacks import MESHSUB, signed_rpcs
from tests.node.p2p.conftest import one_completion_batch, verdict

PEER_PROC = ROOT / "tests" / "node" / "p2p" / "peer_proc.py"


def config() -> Config:
    return load_config(None, {"node.listen": ["/ip4/127.0.0.1/tcp/0"],
                              "p2p.discovery_interval_s": 0.5, "p2p.bootstrap_timeout_s": 10})


def message(kind: str, origin: str, i: int):
    if kind == "verdicts":
        return verdict(i)
    if kind == "rollouts":
        rng = np.random.default_rng(i)
        return one_completion_batch(origin, rng.integers(0, 1000, 200).astype(np.int32),
                                    -rng.random(200).astype(np.float32), i)
    return ShardAdvert(policy_id=origin, version=1000 + i, complete=True)


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def run(args) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if args.victim_pythonpath:
        env["PYTHONPATH"] = args.victim_pythonpath
    log = tempfile.TemporaryFile("w+")  # noqa: SIM115 - the victim's log, closed at exit
    victim = subprocess.Popen(  # noqa: ASYNC220 - its stdout is read in a thread
        [sys.executable, str(PEER_PROC), "--topic", args.kind], stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, stderr=log, text=True, env=env)
    nodes: list[P2PNode] = []
    try:
        info = json.loads(await asyncio.to_thread(victim.stdout.readline))
        vid, vaddr = info["peer_id"], info["addrs"][0]

        async def node(bootstrap: str) -> P2PNode:
            n = P2PNode(Identity.generate(), config())
            await n.start(bootstrap=[bootstrap], discovery=False)
            nodes.append(n)
            return n

        relay = await node(vaddr)
        observer = await node(vaddr)  # asks the victim for its counts; sends no gossip
        honest = await node(relay.listen_addrs[0])
        sybils = [await node(relay.listen_addrs[0]) for _ in range(args.identities)]
        for n in (relay, honest):
            await n.subscribe(args.kind, lambda env, peer: asyncio.sleep(0))
        while honest.peer_id not in relay.gossip.topic_peers(args.kind) or \
                vid not in relay.gossip.topic_peers(args.kind):
            await asyncio.sleep(0.05)
        per_identity = int(args.rate * args.phase)
        t_build = time.process_time()
        frames = [(s, signed_rpcs(s, s.topic(args.kind),
                                  [s.identity.seal(message(args.kind, s.peer_id, i))])[0])
                  for i in range(per_identity) for s in sybils]
        build_cpu = time.process_time() - t_build
        streams = {s.peer_id: await s.open_stream(relay.peer_id, MESHSUB) for s in sybils}

        sent = [0]
        stop = asyncio.Event()

        async def publish_honest() -> None:
            loop = asyncio.get_running_loop()
            start = loop.time()
            while not stop.is_set():
                await honest.publish(args.kind, message(args.kind, honest.peer_id,
                                                        100_000 + sent[0]))
                sent[0] += 1
                await asyncio.sleep(max(0.0, start + sent[0] / args.honest_rate - loop.time()))

        async def stats() -> dict:
            return json.loads(await observer.request(vid, "/test/stats/1.0.0", b"",
                                                     timeout=30))

        samples: list[tuple[str, float, int, int, float]] = []  # phase, t, got, sent, cpu

        async def sample(phase: str) -> None:
            s = await stats()
            samples.append((phase, time.monotonic(), s["by_origin"].get(honest.peer_id, 0),
                            sent[0], cpu_s(victim.pid)))

        async def sample_for(phase: str, seconds: float) -> None:
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                await asyncio.sleep(1.0)
                await sample(phase)

        async def flood() -> None:
            loop = asyncio.get_running_loop()
            start = loop.time()
            for j, (s, frame) in enumerate(frames):
                try:
                    await streams[s.peer_id].write(frame)
                except Exception as e:  # noqa: BLE001 - that sybil was cut: the others go on
                    print(f"flood write failed ({type(e).__name__}): sybil cut", flush=True)
                    continue
                await asyncio.sleep(max(0.0, start + (j + 1) / (len(sybils) * args.rate)
                                        - loop.time()))

        publisher = asyncio.create_task(publish_honest())
        await asyncio.sleep(2)  # the honest flow settles
        await sample("start")
        await sample_for("baseline", args.phase)
        flooding = asyncio.create_task(flood())
        await sample_for("flood", args.phase)
        await flooding
        await sample("flood")
        await sample_for("after", args.phase)
        stop.set()
        await publisher
        final = await stats()
        relay_cut = relay.peer_id in final["health"].get("refused", {}) or \
            final["health"].get("cuts", 0) > 0
        return {"samples": samples, "build_cpu": build_cpu, "flood_messages": len(frames),
                "health": final["health"], "relay_cut": relay_cut,
                "by_origin": final["by_origin"], "honest": honest.peer_id}
    finally:
        for n in nodes:
            await n.close()
        victim.stdin.close()
        try:
            victim.wait(60)
        except subprocess.TimeoutExpired:
            victim.kill()


def summarize(args, r: dict) -> tuple[str, dict]:
    s = r["samples"]
    phases: dict[str, dict] = {}
    for prev, cur in itertools.pairwise(s):
        p = phases.setdefault(cur[0], {"dt": 0.0, "got": 0, "sent": 0, "cpu": 0.0})
        p["dt"] += cur[1] - prev[1]
        p["got"] += cur[2] - prev[2]
        p["sent"] += cur[3] - prev[3]
        p["cpu"] += cur[4] - prev[4]
    base = phases["baseline"]["got"] / phases["baseline"]["dt"]
    flood_end = next(t for (ph, t, *_) in s if ph == "after") - 1.0
    recovery = None
    after = [x for x in s if x[0] == "after"]
    prev = next(x for x in reversed(s) if x[0] == "flood")
    for cur in after:
        if (cur[2] - prev[2]) / (cur[1] - prev[1]) >= 0.95 * base:
            recovery = cur[1] - flood_end
            break
        prev = cur
    flood_got = sum(n for o, n in r["by_origin"].items() if o != r["honest"])
    rows = []
    for name in ("baseline", "flood", "after"):
        p = phases[name]
        rate = p["got"] / p["dt"]
        rows.append(f"| {name} | {p['sent'] / p['dt']:.1f} | {rate:.1f} | "
                    f"{100 * rate / base:.0f}% | {100 * p['cpu'] / p['dt']:.0f}% |")
    victim_cpu_flood = phases["flood"]["cpu"]
    figures = {"baseline": base, "during": phases["flood"]["got"] / phases["flood"]["dt"],
               "after": phases["after"]["got"] / phases["after"]["dt"],
               "recovery_s": recovery, "relay_cut": r["relay_cut"],
               "attacker_ms_per_msg": 1000 * r["build_cpu"] / r["flood_messages"],
               "victim_ms_per_flood_msg": 1000 * victim_cpu_flood / max(1, flood_got)}
    text = (f"**{args.kind}**, {args.identities} identities x {args.rate:g}/s "
            f"({r['flood_messages']} messages in {args.phase:g} s), honest origin at "
            f"{args.honest_rate:g}/s; victim: "
            f"{'this branch' if not args.victim_pythonpath else args.victim_pythonpath}\n\n"
            "| phase | honest sent/s | delivered/s | of baseline | victim CPU |\n"
            "|---|---|---|---|---|\n" + "\n".join(rows) + "\n\n"
            f"Relay cut by the victim: {'yes' if r['relay_cut'] else 'no'}; recovery "
            f"(first 1 s window >= 95% of baseline after the flood): "
            f"{'never within the phase' if recovery is None else f'{recovery:.1f} s'}; "
            f"flood messages the victim took: {flood_got} of {r['flood_messages']}; "
            f"attacker CPU {figures['attacker_ms_per_msg']:.2f} ms per flood message built "
            f"(signatures, framing), victim CPU {figures['victim_ms_per_flood_msg']:.2f} ms "
            f"per flood message it took; victim health: cuts {r['health'].get('cuts')}, "
            f"rate_limited {r['health'].get('rate_limited')}.")
    return text, figures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kind", default="verdicts", choices=["verdicts", "rollouts", "adverts"])
    ap.add_argument("--identities", type=int, default=20)
    ap.add_argument("--rate", type=float, default=10.0, help="messages/s per identity")
    ap.add_argument("--honest-rate", type=float, default=5.0)
    ap.add_argument("--phase", type=float, default=10.0)
    ap.add_argument("--victim-pythonpath", default="")
    ap.add_argument("--section", default="")
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()
    setup_logging("WARNING")  # as a node logs: py-libp2p's own records at CRITICAL
    load = os.getloadavg()[0]
    result = asyncio.run(run(args))
    text, figures = summarize(args, result)
    text += f"\n\nLoad average at the start: {load:.1f} (2 shared cores: read rates as bounds)."
    print(text)
    print(json.dumps(figures))
    if not args.no_record:
        record(args.section or f"gossip-flood-{args.kind}", text)


if __name__ == "__main__":
    main()
