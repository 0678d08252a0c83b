"""Many identities that announce gossip bodies and never serve them (issue #30 item 3 (b)):
what a receiver still delivers of an established announcer's bodies, and how long a
newcomer's first body takes, before, during and after.

In this process, real libp2p hosts on 127.0.0.1: a receiver with default pull settings;
an established honest announcer (its bodies served: proven before the flood); one honest
newcomer per --newcomer-at time; --identities stalling announcers, each its own key and connection to the
receiver, announcing a new body every 1/--rate s and taking every pull of it without ever
answering. Every body is pulled (publishers push nothing: --push 0, the path of a peer with
no push link to the receiver). The established announcer publishes --honest-rate bodies/s
throughout; each newcomer publishes one body a second from its --newcomer-at s into the
flood on (the default 5 and 45: one while the stallers' first pulls are under way, one
after them). Phases of --phase seconds: baseline, flood, after.

Figures: the established bodies delivered per second per phase and as a share of the
baseline; recovery = seconds from the flood's end until a 1 s window delivers >= 95% of
the baseline rate; a newcomer's first delivery = seconds from its first publish to the
first of its bodies delivered; the receiver's pulls of the stallers' bodies from them and
the announces it did not pull (`payload_pull_stalled_announcer`), and its cuts.

    .venv/bin/python benchmarks/body_stall_flood.py [--identities 24] [--phase 60]
        [--rate 1] [--newcomer-at 5,45] [--json OUT]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from swarm_node.node.config import Config, load_config
from swarm_node.node.identity import Identity
from swarm_node.node.logs import setup_logging
from swarm_node.node.p2p import P2PNode

from tests.node.p2p.attacks import MESHSUB, signed_rpcs
from tests.node.p2p.test_payload_plane import KIND, announce_of, batch


def config(push: int) -> Config:
    return load_config(None, {"node.listen": ["/ip4/127.0.0.1/tcp/0"],
                              "p2p.discovery_interval_s": 0.5, "p2p.bootstrap_timeout_s": 30,
                              "p2p.dial_timeout_s": 10, "p2p.payload_push_fanout": push})


async def run(args) -> dict:
    nodes: list[P2PNode] = []

    async def node(bootstrap: list[str]) -> P2PNode:
        n = P2PNode(Identity.generate(), config(args.push))
        await n.start(bootstrap=bootstrap, discovery=False)
        nodes.append(n)
        return n

    try:
        receiver = await node([])
        established = await node(receiver.listen_addrs)
        newcomers = [await node(receiver.listen_addrs) for _ in args.newcomer_at]
        stallers = [await node(receiver.listen_addrs) for _ in range(args.identities)]
        got: dict[str, list[float]] = {}  # origin -> delivery times
        traces: list = []  # the receiver's BodyTrace of every announced body
        receiver.gossip.on_body = traces.append

        async def on_msg(env, origin):
            got.setdefault(origin, []).append(time.monotonic())

        await receiver.subscribe(KIND, on_msg)
        for n in (established, *newcomers):
            await n.subscribe(KIND, lambda env, peer: asyncio.sleep(0))
        while not {n.peer_id for n in (established, *newcomers)} <= set(
                receiver.gossip.mesh_peers(KIND)):
            await asyncio.sleep(0.05)
        while (receiver.metrics["payload_bulk_warmed"]
               + receiver.metrics["payload_bulk_warm_failed"] < len(nodes) - 1):
            await asyncio.sleep(0.05)

        own: dict[str, set[bytes]] = {s.peer_id: set() for s in stallers}
        asked = dict.fromkeys(own, 0)

        def stall_for(staller):
            async def stall(peer, conn):  # takes requests, never answers
                digest = await conn.readexactly(32)
                if peer == receiver.peer_id and digest in own[staller.peer_id]:
                    asked[staller.peer_id] += 1
                await conn.read(1)
            return stall

        streams = {}
        for s in stallers:
            s.bulk.register("body", stall_for(s))
            receiver.bulk.client.forget_idle(s.peer_id, "body")
            streams[s.peer_id] = await s.open_stream(receiver.peer_id, MESHSUB)

        stop, flood_on = asyncio.Event(), asyncio.Event()
        newcomer_sent: list[list[float]] = [[] for _ in newcomers]

        async def publish(who: P2PNode, rate: float, out: list[float] | None = None,
                          start_after: asyncio.Event | None = None, delay: float = 0.0):
            if start_after is not None:
                await start_after.wait()
                await asyncio.sleep(delay)
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            for k in itertools.count():
                if stop.is_set():
                    return
                await who.publish(KIND, batch(who.peer_id, 8192, k))
                if out is not None:
                    out.append(time.monotonic())
                await asyncio.sleep(max(0.0, t0 + (k + 1) / rate - loop.time()))

        async def flood(until: asyncio.Event) -> None:
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            for j in itertools.count():
                if until.is_set():
                    return
                s = stallers[j % len(stallers)]
                _, ann, sealed = announce_of(s, batch(s.peer_id, 8192, j))
                own[s.peer_id].add(ann.content_hash)
                await streams[s.peer_id].write(signed_rpcs(s, s.topic(KIND), [sealed])[0])
                await asyncio.sleep(max(0.0, t0 + (j + 1) / (len(stallers) * args.rate)
                                        - loop.time()))

        tasks = [asyncio.create_task(publish(established, args.honest_rate)),
                 *(asyncio.create_task(publish(n, 1.0, sent, flood_on, at))
                   for n, sent, at in zip(newcomers, newcomer_sent, args.newcomer_at,
                                          strict=True))]
        await asyncio.sleep(2)  # the established flow settles (and is proven)
        marks = {"baseline": time.monotonic()}
        await asyncio.sleep(args.phase)
        flood_stop = asyncio.Event()
        marks["flood"] = time.monotonic()
        flood_on.set()
        flooding = asyncio.create_task(flood(flood_stop))
        await asyncio.sleep(args.phase)
        flood_stop.set()
        await flooding
        marks["after"] = time.monotonic()
        await asyncio.sleep(args.phase)
        marks["end"] = time.monotonic()
        stop.set()
        await asyncio.gather(*tasks)
        m = receiver.metrics
        staller_ids = {s.peer_id for s in stallers}
        # how long each staller pull held its slot, and where a newcomer's first body waited
        held = sorted(t.pulling for t in traces if t.origin in staller_ids and t.pulling > 0)
        firsts = [next(((t.queued, t.pulling) for t in traces if t.origin == n.peer_id
                        and t.via == "pull"), None) for n in newcomers]
        return {"marks": marks, "staller_pull_s": held, "newcomer_first_trace": firsts, "established": got.get(established.peer_id, []),
                "newcomers": [got.get(n.peer_id, []) for n in newcomers],
                "newcomer_sent": newcomer_sent,
                "asked": sorted(asked.values()), "announced": sum(map(len, own.values())),
                "skipped": m["payload_pull_stalled_announcer"],
                "unserved": m["rejected.unserved_announce"],
                "cuts": sum(1 for s in stallers if s.peer_id not in
                            receiver.connected_peers())}
    finally:
        for n in nodes:
            await n.close()


def summarize(args, r: dict) -> tuple[str, dict]:
    marks, times = r["marks"], r["established"]

    def rate(a: float, b: float) -> float:
        return sum(1 for t in times if a <= t < b) / (b - a)

    base = rate(marks["baseline"], marks["flood"])
    during = rate(marks["flood"], marks["after"])
    after = rate(marks["after"], marks["end"])
    recovery = None
    for k in range(int(args.phase)):
        a = marks["after"] + k
        if rate(a, a + 1) >= 0.95 * base:
            recovery = k + 1.0
            break
    firsts = [got[0] - sent[0] if got and sent else None
              for got, sent in zip(r["newcomers"], r["newcomer_sent"], strict=True)]
    newcomer_text = "; ".join(
        f"published {at:g} s into the flood: first body after "
        f"{'never' if first is None else f'{first:.1f} s'}, {len(got)} of its {len(sent)} "
        f"delivered" for at, first, got, sent in zip(args.newcomer_at, firsts, r["newcomers"],
                                                     r["newcomer_sent"], strict=True))
    figures = {"baseline": base, "during": during, "after": after, "recovery_s": recovery,
               "newcomer_at": args.newcomer_at, "newcomer_first_s": firsts,
               "newcomer_delivered": [len(x) for x in r["newcomers"]],
               "newcomer_sent": [len(x) for x in r["newcomer_sent"]], "asked": r["asked"],
               "announced": r["announced"], "skipped": r["skipped"],
               "unserved": r["unserved"], "cut": r["cuts"],
               "staller_pull_s": r["staller_pull_s"],
               "newcomer_first_trace": r["newcomer_first_trace"]}
    held = r["staller_pull_s"]
    held_text = (f"{len(held)} staller pulls held a slot {held[len(held) // 2]:.1f} s "
                 f"median, {held[-1]:.1f} s max" if held else "no staller pull held a slot")
    trace_text = ", ".join("?" if t is None else f"queued {t[0]:.1f} s + pulling {t[1]:.1f} s"
                           for t in r["newcomer_first_trace"])
    text = (f"{args.identities} stalling identities x {args.rate:g} announces/s, established "
            f"announcer at {args.honest_rate:g} bodies/s, phases of {args.phase:g} s; "
            f"established bodies/s: baseline {base:.1f}, flood {during:.1f} "
            f"({100 * during / base:.0f}%), after {after:.1f} ({100 * after / base:.0f}%); "
            f"recovery {'none within the phase' if recovery is None else f'{recovery:.0f} s'}; "
            f"newcomers: {newcomer_text}; stallers' "
            f"bodies pulled from them {sum(r['asked'])} of {r['announced']} announced "
            f"(per staller {min(r['asked'])}-{max(r['asked'])}), not pulled "
            f"{r['skipped']}, unserved charges {r['unserved']}, stallers cut {r['cuts']}; "
            f"{held_text}; newcomers' first bodies: {trace_text}")
    return text, figures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--identities", type=int, default=24)
    ap.add_argument("--rate", type=float, default=1.0, help="announces/s per staller")
    ap.add_argument("--honest-rate", type=float, default=10.0)
    ap.add_argument("--phase", type=float, default=60.0)
    ap.add_argument("--newcomer-at", type=lambda v: [float(x) for x in v.split(",")],
                    default=[5.0, 45.0], help="seconds into the flood, one newcomer each")
    ap.add_argument("--push", type=int, default=0, help="p2p.payload_push_fanout")
    ap.add_argument("--json", default="", help="also write the figures here")
    args = ap.parse_args()
    setup_logging("WARNING")
    load = os.getloadavg()[0]
    text, figures = summarize(args, asyncio.run(run(args)))
    figures["load"] = load
    print(text + f"; load at the start {load:.1f}")
    print(json.dumps(figures))
    if args.json:
        Path(args.json).write_text(json.dumps(figures))


if __name__ == "__main__":
    main()
