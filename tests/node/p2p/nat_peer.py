"""A P2PNode in its own process, for the NAT lab tests (run inside a lab host's namespace).

Prints one JSON line {"peer_id", "addrs"} once started, then answers commands read from
stdin, one JSON line each:
  status           -> {"reachability", "connected", "relayed", "relay", "counters",
                       "mesh", "got", "peer_reach"}  (got: [origin, round] of each rollouts
                       batch received; peer_reach: health()'s kind per peer)
  connect <addr>   -> {"ok": bool, "error": str}
  ask <peer>       -> {"ok": bool, "reply": str, "error": str}  (a request to /test/echo)
  publish <round>  -> {"ok": bool, "error": str}  (a ~64 KiB RolloutBatch: announced, pulled)
Exits cleanly when stdin closes.
Usage: python nat_peer.py --listen MULTIADDR [--bootstrap MULTIADDR]... [--relay] [--fast]
       [--bulk]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

import numpy as np


async def main() -> int:
    from swarm_node.node.config import load_config
    from swarm_node.node.identity import Identity
    from swarm_node.node.p2p import P2PError, P2PNode

    ap = argparse.ArgumentParser()
    ap.add_argument("--listen", required=True)
    ap.add_argument("--bootstrap", action="append", default=[])
    ap.add_argument("--relay", action="store_true", help="serve as a relay (hop)")
    ap.add_argument("--bulk", action="store_true",
                    help="serve a bulk plane (default: off; pushed bodies need one)")
    ap.add_argument("--fast", action="store_true",
                    help="short liveness and dial timeouts (partition tests)")
    args = ap.parse_args()
    overrides = {"node.listen": [args.listen], "p2p.discovery_interval_s": 0.5,
                 "p2p.bootstrap_timeout_s": 30,
                 "p2p.relay.service": "on" if args.relay else "off"}
    if not args.bulk:
        overrides["bulk.listen"] = "off"
    if args.fast:
        overrides.update({"p2p.liveness_interval_s": 2.0, "p2p.dial_timeout_s": 3.0})
    cfg = load_config(None, overrides)
    node = P2PNode(Identity.generate(), cfg)

    async def echo(peer: str, body: bytes) -> bytes:
        return body[::-1]

    got: list[list] = []

    async def on_batch(env, peer: str) -> None:
        got.append([peer, env.message.round])

    await node.set_request_handler("/test/echo/1.0.0", echo)
    await node.subscribe("rollouts", on_batch)
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
                 "relay": node.relay.stats(), "counters": dict(node.metrics.counters),
                 "mesh": node.gossip.mesh_peers("rollouts"), "got": got,
                 "peer_reach": node.health()["peer_reach"]})
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
        elif cmd == "publish":
            try:
                await node.publish("rollouts", batch(node.peer_id, int(arg)))
                say({"ok": True, "error": ""})
            except P2PError as e:
                say({"ok": False, "error": str(e)})
        else:
            say({"error": f"unknown command {cmd!r}"})
    await node.close()
    return 0


def batch(policy_id: str, round_: int, n_tokens: int = 8192):
    """A valid RolloutBatch of ~8 bytes per token (64 KiB: above the inline maximum)."""
    from swarm_node.protocol.messages import (
        Completion,
        RolloutBatch,
        SamplingParams,
        TaskRef,
        TensorData,
    )

    comp = Completion(task=TaskRef(dataset="toy/digit_successor", seed=1, index=round_),
                      prompt_ids=TensorData.from_numpy(np.arange(8, dtype=np.int32)),
                      completion_ids=TensorData.from_numpy(
                          np.arange(n_tokens, dtype=np.int32) % 1000),
                      logprobs=TensorData.from_numpy(np.full(n_tokens, -0.5, np.float32)),
                      finish_reason="length", seed=3, claimed_reward=0.5)
    return RolloutBatch(swarm_id="default", round=round_, policy_id=policy_id,
                        policy_version=0, sampling=SamplingParams(), completions=[comp])


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
