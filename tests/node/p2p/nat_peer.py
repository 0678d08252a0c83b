"""A P2PNode in its own process, for the NAT lab tests (run inside a lab host's namespace).

Prints one JSON line {"peer_id", "addrs"} once started, then answers commands read from
stdin, one JSON line each:
  status           -> {"reachability", "connected", "relayed", "relay", "counters"}
  connect <addr>   -> {"ok": bool, "error": str}
  ask <peer>       -> {"ok": bool, "reply": str, "error": str}  (a request to /test/echo)
Exits cleanly when stdin closes.
Usage: python nat_peer.py --listen MULTIADDR [--bootstrap MULTIADDR]... [--relay] [--fast]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys


async def main() -> int:
    from swarm_node.node.config import load_config
    from swarm_node.node.identity import Identity
    from swarm_node.node.p2p import P2PError, P2PNode

    ap = argparse.ArgumentParser()
    ap.add_argument("--listen", required=True)
    ap.add_argument("--bootstrap", action="append", default=[])
    ap.add_argument("--relay", action="store_true", help="serve as a relay (hop)")
    ap.add_argument("--fast", action="store_true",
                    help="short liveness and dial timeouts (partition tests)")
    args = ap.parse_args()
    overrides = {"node.listen": [args.listen], "p2p.discovery_interval_s": 0.5,
                 "p2p.bootstrap_timeout_s": 30, "bulk.listen": "off",
                 "p2p.relay.service": "on" if args.relay else "off"}
    if args.fast:
        overrides.update({"p2p.liveness_interval_s": 2.0, "p2p.dial_timeout_s": 3.0})
    cfg = load_config(None, overrides)
    node = P2PNode(Identity.generate(), cfg)

    async def echo(peer: str, body: bytes) -> bytes:
        return body[::-1]

    await node.set_request_handler("/test/echo/1.0.0", echo)
    await node.start(bootstrap=args.bootstrap)

    def say(obj) -> None:
        print(json.dumps(obj), flush=True)

    say({"peer_id": node.peer_id, "addrs": node.listen_addrs})
    while line := await asyncio.to_thread(sys.stdin.readline):
        cmd, _, arg = line.strip().partition(" ")
        if cmd == "status":
            peers = node.connected_peers()
            say({"reachability": node.reachability.as_dict(), "connected": peers,
                 "relayed": [p for p in peers if node.is_relayed(p)],
                 "relay": node.relay.stats(), "counters": dict(node.metrics.counters)})
        elif cmd == "connect":
            try:
                await node.connect(arg)
                say({"ok": True, "error": ""})
            except P2PError as e:
                say({"ok": False, "error": str(e)})
        elif cmd == "ask":
            try:
                reply = await node.request(arg, "/test/echo/1.0.0", b"olleh", timeout=10)
                say({"ok": True, "reply": reply.decode(), "error": ""})
            except P2PError as e:
                say({"ok": False, "reply": "", "error": str(e)})
        else:
            say({"error": f"unknown command {cmd!r}"})
    await node.close()
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
