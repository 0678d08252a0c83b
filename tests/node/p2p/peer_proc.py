"""A swarm peer in its own process, driven by the p2p tests and the gossip benchmark.

Prints one JSON line {"peer_id", "addrs"} when up; serves /test/echo/1.0.0 (reversed bytes),
/test/raw-echo/1.0.0 (raw stream echo), /test/sink/1.0.0 (never reads) and
/test/stats/1.0.0 (JSON: messages received per origin, health); subscribes to
"verdicts" (and each --topic) and counts each message it receives. Exits cleanly when stdin closes; then prints
a final JSON report (counts, health, counters, shutdown errors).
Usage: python peer_proc.py [--key PEM] [--bootstrap MULTIADDR]...
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import threading


async def main() -> int:
    from swarm_node.node.config import load_config
    from swarm_node.node.identity import Identity
    from swarm_node.node.logs import setup_logging
    from swarm_node.node.p2p import P2PNode

    setup_logging("INFO")  # as a real node logs (py-libp2p's own records at CRITICAL)

    ap = argparse.ArgumentParser()
    ap.add_argument("--key")
    ap.add_argument("--bootstrap", action="append", default=[])
    ap.add_argument("--discovery-interval", type=float, default=0.5)
    ap.add_argument("--topic", action="append", default=[],
                    help="also count the messages of this topic kind (verdicts always)")
    args = ap.parse_args()
    cfg = load_config(None, {"node.listen": ["/ip4/127.0.0.1/tcp/0"],
                             "p2p.discovery_interval_s": args.discovery_interval,
                             "p2p.bootstrap_timeout_s": 10})
    ident = Identity.load_or_create(args.key) if args.key else Identity.generate()
    node = P2PNode(ident, cfg)

    async def echo(peer: str, body: bytes) -> bytes:
        return body[::-1]

    async def raw_echo(peer: str, stream) -> None:
        while data := await stream.read(1 << 20):
            await stream.write(data)

    received = []
    by_origin: dict[str, int] = {}

    async def on_status(env, peer):
        received.append(getattr(env.message, "policy_version", 0))
        by_origin[peer] = by_origin.get(peer, 0) + 1

    async def stats(peer: str, body: bytes) -> bytes:
        return json.dumps({"by_origin": by_origin, "health": node.health()}).encode()

    async def sink(peer: str, stream) -> None:
        await asyncio.Event().wait()  # never reads: a peer that ignores the window fills it

    node.set_request_handler("/test/echo/1.0.0", echo)
    node.set_stream_handler("/test/raw-echo/1.0.0", raw_echo, max_inbound=64 << 20)
    node.set_stream_handler("/test/sink/1.0.0", sink, max_inbound=1 << 30)
    node.set_request_handler("/test/stats/1.0.0", stats)
    await node.start(bootstrap=args.bootstrap)
    for kind in dict.fromkeys(["verdicts", *args.topic]):
        await node.subscribe(kind, on_status)
    print(json.dumps({"peer_id": node.peer_id, "addrs": node.listen_addrs}), flush=True)
    await asyncio.to_thread(sys.stdin.read)  # until the test closes our stdin
    health = node.health()
    await node.close()
    leftover = [t.name for t in threading.enumerate()
                if t.name.startswith("p2p-") or "_background_cleanup" in t.name]
    print(json.dumps({"received": len(received), "by_origin": by_origin,
                      "health": health, "counters": dict(node.metrics.counters),
                      "shutdown_errors": node.shutdown_errors,
                      "leftover_threads": leftover}), flush=True)
    return 0


if __name__ == "__main__":
    code = asyncio.run(main())
    # The node is closed and its report flushed. The interpreter's own teardown (freeing
    # ~1,450 modules, py-libp2p's import graph) took 1.6 s of CPU, ten times the close:
    # on a loaded machine the test waiting for this exit timed out. Nothing is left to do.
    sys.stdout.flush()
    os._exit(code)
