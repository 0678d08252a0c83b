"""Restarts are honest (issue 30 finding 6, issue 29 finding 4), with real `swarm-node join`
processes on loopback (tiny model): a trainer, an honest inference peer following it, and
in this test process a third libp2p peer that records the inference peer's gossip.

After the trainer restarts on its data dir it resumes the swarm ("resumed swarm"),
the third party replays the peer's already-accepted messages to it, and the peer's rounds,
before and after, are never rejected, counted or held against it: no reject in the peer's
own `verdicts_about_me`, none in the trainer's counts, none in its persisted reputation. A
stop (SIGINT) takes no new work: after the "stopping" line the trainer verifies no new
round and starts no new step.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time

import pytest

from ..waiting import async_wait_until
from .test_operator import Node, free_port, trainer_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

MESHSUB = "/meshsub/1.1.0"


def free_ports(n: int = 3) -> int:
    """A port p with p .. p + n - 1 free (libp2p, and the "auto" side planes at +1, +2)."""
    import socket

    for _ in range(50):
        p = free_port()
        socks = []
        try:
            for k in range(n):
                s = socket.socket()
                s.bind(("127.0.0.1", p + k))
                socks.append(s)
            return p
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free port range")


async def until(pred, timeout: float, what: str, node: Node | None = None):
    """`pred()`'s first true value, polled with a deadline (another process's /status:
    nothing signals it); fails at once if `node` exits."""
    got = []

    def check() -> bool:
        if node is not None and node.proc.poll() is not None:
            return True
        value = pred()
        if value:
            got.append(value)
        return bool(value)

    await async_wait_until(check, timeout, what, interval=0.3,
                           details=lambda: node.log.read_text()[-3000:] if node else "")
    if not got:
        pytest.fail(f"node exited {node.proc.returncode} while waiting for {what}:\n"
                    f"{node.log.read_text()[-3000:]}")
    return got[0]


def accepted_from(trainer: Node, peer: str) -> int:
    return (trainer.status().get("accepted_by_peer") or {}).get(peer, {}).get("accepted", 0)


def mine(peer: Node) -> dict:
    return peer.status().get("verdicts_about_me") or {}


async def recorder(swarm_id: str, bootstrap: str):
    """A plain libp2p peer of the swarm that keeps every gossip message it validates (the
    raw pubsub message, signed by its origin), so it can forward them again later."""
    from swarm_node.node.config import Config
    from swarm_node.node.identity import Identity
    from swarm_node.node.p2p import P2PNode

    cfg = Config.model_validate({"node": {"listen": ["/ip4/127.0.0.1/tcp/0"],
                                          "swarm_id": swarm_id}})
    node = P2PNode(Identity.generate(), cfg)
    await node.start(bootstrap=[bootstrap], discovery=True)
    node.kept = []
    validator = node.gossip.validator
    take = validator.take

    def keep(msg):
        node.kept.append(msg.SerializeToString())
        return take(msg)

    validator.take = keep
    await node.subscribe("rollouts", lambda env, origin: asyncio.sleep(0))
    return node


async def replay(node, peer_id: str, raws: list[bytes]) -> None:
    """Forward `raws` (pubsub messages as first gossiped) to `peer_id`, as gossip does."""
    from libp2p.pubsub.pb import rpc_pb2
    from libp2p.utils.varint import encode_uvarint

    rpc = rpc_pb2.RPC()
    for raw in raws:
        rpc.publish.append(rpc_pb2.Message.FromString(raw))
    body = rpc.SerializeToString()
    stream = await node.open_stream(peer_id, MESHSUB)
    await stream.write(encode_uvarint(len(body)) + body)
    await stream.close()


async def test_6_a_restarted_trainer_treats_honest_rounds_as_before(tmp_path, tiny_model_dir):
    from swarm_node.verifier.reputation import Reputation

    port = free_ports()
    tcfg = trainer_config(tmp_path / "t", tiny_model_dir, peer_batches_per_step=1,
                          peer_wait_s=5.0)
    tcfg["node"]["listen"] = [f"/ip4/127.0.0.1/tcp/{port}"]
    tcfg["sampler"]["batches_per_version"] = 1  # a swarm setting: the peer uses the same
    trainer = Node(tmp_path / "t", tcfg).start()
    peer = observer = None
    try:
        tid = trainer.wait_listening()["peer_id"]  # the others start while it loads
        boot = f"/ip4/127.0.0.1/tcp/{port}/p2p/{tid}"
        pcfg = {
            "node": {"role": "inference", "swarm_id": tcfg["node"]["swarm_id"],
                     "data_dir": str(tmp_path / "p" / "data"),
                     "listen": ["/ip4/127.0.0.1/tcp/0"], "bootstrap": [boot], "follow": [tid]},
            "model": {"name": str(tiny_model_dir)},
            "admin": {"port": 0},
            "tasks": tcfg["tasks"],
            "sampler": {**tcfg["sampler"], "version_wait_s": 5.0},
            "p2p": {"reconnect_max_backoff_s": 2.0},
        }
        peer = Node(tmp_path / "p", pcfg).start()
        observer = await recorder(tcfg["node"]["swarm_id"], boot)
        trainer.wait_joined()
        peer.wait_joined()
        pid = peer.status()["peer_id"]
        await until(lambda: accepted_from(trainer, pid) >= 8 and len(observer.kept) >= 2,
                    300, "accepted rounds of the peer, seen by the recorder", trainer)
        kept = list(observer.kept)

        # Ctrl-C: no new round verified, no new step started after the "stopping" line
        t0 = time.monotonic()
        trainer.proc.send_signal(signal.SIGINT)
        assert trainer.proc.wait(timeout=120) == 0
        stop_s = time.monotonic() - t0
        first_run = trainer.log.read_text()
        after_stop = first_run.split("stopping: waiting for", 1)[1]
        assert after_stop.count("verified round") <= 1, after_stop[-3000:]
        assert after_stop.count("train step ->") <= 1, after_stop[-3000:]
        print(f"trainer stopped {stop_s:.1f} s after SIGINT")

        trainer.start()  # the same data dir, key and port

        def second() -> str:
            text = trainer.log.read_text()[len(first_run):]
            return text if "joined swarm" in text else ""

        second_run = await until(second, 120, "the restarted trainer", trainer)
        assert "resumed swarm" in second_run and "started swarm" not in second_run
        await observer.connect(boot)
        await replay(observer, tid, kept)
        await until(lambda: trainer.status().get("counters", {}).get(
            "batches_already_accepted", 0) >= 1, 120, "the replays to be verified", trainer)
        before = mine(peer).get("accepted", 0)
        await until(lambda: mine(peer).get("accepted", 0) > before
                    and accepted_from(trainer, pid) > 0, 300,
                    "new rounds of the peer accepted after the restart", trainer)
        status = trainer.status()
        counts = status["accepted_by_peer"][pid]
        assert counts["rejected"] == 0, counts  # the replays were not held against it
        assert not mine(peer).get("rejected"), mine(peer)  # nothing red on the peer's side
    finally:
        if observer is not None:
            await observer.close()
        if peer is not None:
            peer.stop()
        trainer.stop()
    rep = Reputation(trainer.data / "reputation.json")
    rec = rep.peers.get(pid)
    assert rec is not None and rec.rejected == 0 and rec.accepted > 0, rec
    log = peer.log.read_text()
    assert "round_reused" not in log and "rejected a rollout of mine" not in log
    assert json.loads((trainer.data / "node.json").read_text())["peer_id"] == tid
