"""A real swarm: trainer, relay, two honest inference peers and a cheater, each a
`swarm-node join` subprocess on loopback with its own key, data dir and admin endpoint
(forked warm: tests/launch.py; the demo itself execs them, tests/node/test_demo.py).

One swarm serves four checks, in order (its processes cost most of the time on 2 cores):
  0. the admin endpoint (/status, /metrics) answers on 127.0.0.1 and nowhere else;
  1. the trainer's version advances at least twice, the inference peers hot-load each
     version (their status and their accepted rollouts carry the new versions), rollouts
     flow and are accepted, and /status reports it;
  2. the cheater's rollouts never reach the trainer's buffer, and it is banned;
  3. kill -9 of the trainer, restart with the same key and port: it resumes from its last
     checkpoint and the swarm carries on (a new version, rollouts accepted again).
Nothing signals these from the nodes' side but /status, so the test polls it.
"""

from __future__ import annotations

import json
import signal
import socket
import urllib.request

import pytest
from swarm_node.node.demo import (
    DemoNode,
    fetch_status,
    node_config,
    stop_nodes,
    wait_info,
)

from tests.launch import start_demo_node as start_node
from tests.waiting import wait_until

from .pacing import PACE

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def wait_swarm(pred, timeout: float, nodes: list[DemoNode], what: str) -> None:
    """Refresh every node's /status until `pred()` holds; fail at once if a node exits."""
    def check() -> bool:
        for n in nodes:
            fetch_status(n)
            if n.proc is not None and n.proc.poll() is not None:
                pytest.fail(f"{n.name} exited with {n.proc.returncode}:\n"
                            f"{n.log_path.read_text()[-3000:]}")
        return pred()

    def logs() -> str:
        return "\n".join(f"--- {n.name}\n{n.log_path.read_text(errors='replace')[-2500:]}"
                         for n in nodes)

    wait_until(check, timeout, what, interval=0.25, details=logs)


def assert_admin_is_loopback_only(node: DemoNode) -> None:
    """The admin endpoint answers on 127.0.0.1 and nowhere else."""
    port = node.info["admin_port"]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=30) as r:
        st = json.loads(r.read())
    assert st["role"] == node.role and st["peer_id"] == node.info["peer_id"]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        assert b"# TYPE" in r.read()
    addrs = {a[4][0] for a in socket.getaddrinfo(socket.gethostname(), None)
             if a[0] == socket.AF_INET} - {"127.0.0.1", "127.0.1.1"}
    for addr in addrs:
        with pytest.raises(OSError):
            socket.create_connection((addr, port), timeout=2).close()


def test_swarm_trains_bans_cheater_and_survives_trainer_kill(tmp_path, tiny_model_dir):
    trainer = DemoNode("trainer", "trainer", tmp_path / "trainer")
    relay = DemoNode("relay", "relay", tmp_path / "relay")
    honest = [DemoNode(f"inf{i}", "inference", tmp_path / f"inf{i}") for i in (1, 2)]
    cheater = DemoNode("cheater", "inference", tmp_path / "cheater", dishonest="tamper_tokens")
    nodes = [trainer, relay, *honest, cheater]
    swarm = "itest"
    try:
        tcfg = node_config(trainer, tiny_model_dir, [], [], swarm)
        # paced (pacing.py): a step every 3 s on what arrived, not one per peer batch (the
        # demo's): stepping per batch, the trainer and three peers sampled flat out. After
        # the restart the peers may have sent every round of the version it resumed at, and
        # wait for the next: it comes 3 s later
        tcfg["trainer"].update(PACE)
        start_node(trainer, tcfg)
        info = wait_info(trainer)
        tid, boot = info["peer_id"], [info["listen_addrs"][0]]
        for n in nodes[1:]:
            start_node(n, node_config(n, tiny_model_dir, boot, [tid], swarm))
        for n in nodes[1:]:
            wait_info(n)
        ids = {n.name: n.info["peer_id"] for n in nodes}

        # 0. the admin endpoint is loopback-only (on the relay: any node serves the same)
        assert_admin_is_loopback_only(relay)

        def by_peer(name):
            return trainer.last_status.get("accepted_by_peer", {}).get(ids[name], {})

        # 1. versions advance, inference peers hot-load them, their rollouts are accepted
        wait_swarm(lambda: trainer.last_status.get("policy_version", 0) >= 2
                   and all(n.last_status.get("policy_version", 0) >= 2 for n in honest)
                   and all(by_peer(n.name).get("accepted", 0) > 0 for n in honest),
                   420, nodes, "trainer v>=2, honest peers on v>=2 with accepted rollouts")
        st = trainer.last_status
        assert st["role"] == "trainer" and st["peer_id"] == tid
        assert set(st["peers"]) & {ids["relay"], ids["inf1"], ids["inf2"]}
        for n in honest:
            assert n.last_status["rollouts_sent"] > 0
            assert by_peer(n.name).get("rejected", 0) == 0, by_peer(n.name)
        assert relay.last_status.get("policy_version", 0) >= 1  # the relay mirrored versions

        # 2. the cheater is caught: nothing accepted, banned
        wait_swarm(lambda: ids["cheater"] in trainer.last_status.get("banned", []),
                   240, nodes, "cheater banned")
        assert by_peer("cheater").get("accepted", 0) == 0
        assert by_peer("cheater").get("rejected", 0) > 0

        # 3. kill -9 the trainer; restart it with the same key and port
        version_before = trainer.last_status["policy_version"]
        trainer.proc.send_signal(signal.SIGKILL)
        trainer.proc.wait()
        port = boot[0].split("/tcp/")[1].split("/")[0]
        tcfg["node"]["listen"] = [f"/ip4/127.0.0.1/tcp/{port}"]
        tcfg["node"]["bootstrap"] = [relay.info["listen_addrs"][0]]
        (trainer.dir / "data" / "node.json").unlink()
        start_node(trainer, tcfg)
        wait_info(trainer)
        trainer.last_status = {}
        wait_swarm(lambda: trainer.last_status.get("phase") == "running", 180, nodes,
                   "restarted trainer running (resumed its checkpoint)")
        resumed = trainer.last_status["policy_version"]
        assert resumed >= version_before - 1  # from its last checkpoint, not from scratch
        # a new version, and rollouts accepted by the restarted process (its counters
        # start at zero)
        wait_swarm(lambda: trainer.last_status.get("policy_version", 0) >= resumed + 1
                   and trainer.last_status.get("rollouts_accepted", 0) > 0,
                   300, nodes, "swarm carries on after the trainer restart")
        assert ids["cheater"] in trainer.last_status["banned"]  # the ban was persisted

        # SIGTERM: every node shuts down cleanly (exit code 0, not killed after the grace)
        codes = stop_nodes(nodes, grace=120.0)
        assert codes == {n.name: 0 for n in nodes}, codes
    finally:
        stop_nodes(nodes)
