"""Admin endpoint: a real server on 127.0.0.1 port 0, real HTTP requests."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families
from swarm_node.node.admin import AdminServer, find_port, print_status
from swarm_node.node.config import load_config
from swarm_node.node.errors import NodeError
from swarm_node.node.metrics import MAX_REASONS, MAX_TRACKED_PEERS, OTHER_PEERS, NodeState

PEER = "12D3KooWPeerOfThisNode"


class FakeP2P:
    """Stands in for P2PNode's two read-only views the state uses (logic test only)."""

    def __init__(self, peers):
        self.peers = peers
        self.metrics = type("M", (), {"counters": {"published": 5, "rejected.stale": 2}})()

    def connected_peers(self):
        return self.peers


def make_state() -> NodeState:
    st = NodeState(peer_id=PEER, role="trainer", swarm_id="demo")
    st.p2p = FakeP2P(["12D3KooWA", "12D3KooWB"])
    st.policy_id = PEER
    st.policy_version = 3
    st.reward = 0.625
    st.rollouts_sent = 12
    st.accept("12D3KooWA", 8)
    st.reject("12D3KooWCheat", "bad_proof", 3)
    st.reject("12D3KooWCheat", "bad_logprobs")
    st.banned.append("12D3KooWCheat")
    st.versions_published = 3
    st.count("train_steps", 3)
    st.set_checkpoint_progress(3, 2, 5, 8192, 20480)
    return st


def get(port: int, path: str) -> tuple[int, str, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
            return r.status, r.headers["Content-Type"], r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers["Content-Type"], e.read()


async def aget(port, path):
    return await asyncio.to_thread(get, port, path)


async def raw(port: int, data: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    await writer.drain()
    out = await asyncio.wait_for(reader.read(), 15)
    writer.close()
    return out


async def test_status_json(tmp_path):
    state = make_state()
    async with AdminServer(state, port=0, port_file=tmp_path / "admin.port") as server:
        code, ctype, body = await aget(server.port, "/status")
        assert code == 200 and ctype == "application/json"
        doc = json.loads(body)
        assert doc["peer_id"] == PEER and doc["role"] == "trainer" and doc["swarm_id"] == "demo"
        assert doc["connected_peers"] == 2 and doc["peers"] == ["12D3KooWA", "12D3KooWB"]
        assert doc["policy_version"] == 3 and doc["reward"] == 0.625
        assert doc["rollouts_sent"] == 12 and doc["rollouts_accepted"] == 8
        assert doc["rollouts_rejected"] == {"bad_proof": 3, "bad_logprobs": 1}
        assert doc["accepted_by_peer"]["12D3KooWCheat"]["rejected"] == 4
        assert doc["checkpoint_progress"] == {
            "version": 3, "shards_done": 2, "shards_total": 5, "bytes_done": 8192,
            "bytes_total": 20480, "complete": False, "rate_bytes_s": None, "eta_s": None}
        # Live: a later change shows in the next request.
        state.policy_version = 4
        state.accept("12D3KooWB")
        doc = json.loads((await aget(server.port, "/status"))[2])
        assert doc["policy_version"] == 4 and doc["rollouts_accepted"] == 9


async def test_metrics_prometheus_text(tmp_path):
    state = make_state()
    async with AdminServer(state, port=0) as server:
        code, ctype, body = await aget(server.port, "/metrics")
    assert code == 200 and ctype.startswith("text/plain; version=0.0.4")
    samples = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    assert samples[("swarm_node_info", (("peer_id", PEER), ("role", "trainer"),
                                        ("swarm_id", "demo")))] == 1
    assert samples[("swarm_node_policy_version", ())] == 3
    assert samples[("swarm_node_connected_peers", ())] == 2
    assert samples[("swarm_node_reward", ())] == 0.625
    assert samples[("swarm_node_rollouts_sent_total", ())] == 12
    assert samples[("swarm_node_rollouts_accepted_total", ())] == 8
    assert samples[("swarm_node_rollouts_rejected_total", (("reason", "bad_proof"),))] == 3
    assert samples[("swarm_node_banned_peers", ())] == 1
    assert samples[("swarm_node_events_total", (("event", "train_steps"),))] == 3
    assert samples[("swarm_node_checkpoint_progress", (("field", "shards_total"),))] == 5
    assert samples[("swarm_node_p2p_events_total", (("name", "published"),))] == 5
    assert samples[("swarm_node_p2p_rejected_total", (("reason", "stale"),))] == 2


async def test_registries_are_per_node():
    a, b = NodeState("12D3KooWa", "relay", "s"), NodeState("12D3KooWb", "inference", "s")
    assert a.registry is not b.registry and a.registry is a.registry
    async with AdminServer(a, port=0) as sa, AdminServer(b, port=0) as sb:
        assert sa.port != sb.port
        assert b'peer_id="12D3KooWa"' in (await aget(sa.port, "/metrics"))[2]
        assert b'peer_id="12D3KooWb"' in (await aget(sb.port, "/metrics"))[2]
    assert not any(n.startswith("swarm_node") for n in REGISTRY._names_to_collectors)


def test_label_and_peer_cardinality_are_bounded():
    st = NodeState("12D3KooWx", "trainer", "s")
    for i in range(MAX_TRACKED_PEERS + 10):
        st.reject(f"peer{i}", f"reason{i % 100}")
    assert len(st.by_peer) == MAX_TRACKED_PEERS + 1
    assert st.by_peer[OTHER_PEERS].rejected == 10
    from prometheus_client import generate_latest

    text = generate_latest(st.registry).decode()
    reasons = [line for line in text.splitlines()
               if line.startswith("swarm_node_rollouts_rejected_total{")]
    assert len(reasons) == MAX_REASONS and any('reason="other"' in r for r in reasons)
    assert sum(float(r.rsplit(" ", 1)[1]) for r in reasons) == MAX_TRACKED_PEERS + 10


async def test_binds_loopback_only_and_writes_port_file(tmp_path):
    port_file = tmp_path / "data" / "admin.port"
    server = AdminServer(NodeState("12D3KooWx", "relay", "s"), port=0, port_file=port_file)
    await server.start()
    try:
        hosts = {s.getsockname()[0] for s in server._server.sockets}
        assert hosts == {"127.0.0.1"}
        assert port_file.read_text().strip() == str(server.port)
    finally:
        await server.close()
    assert not port_file.exists()
    await server.close()  # idempotent


async def test_config_port_and_port_in_use(tmp_path):
    cfg = load_config(None, {"node.data_dir": str(tmp_path), "admin.port": 0})
    async with AdminServer(NodeState("12D3KooWx", "relay", "s"), cfg) as first:
        assert (tmp_path / "admin.port").read_text().strip() == str(first.port)
        fixed = load_config(None, {"node.data_dir": str(tmp_path / "b"),
                                   "admin.port": first.port})
        with pytest.raises(NodeError, match=f"127.0.0.1:{first.port}.*admin.port"):
            await AdminServer(NodeState("12D3KooWy", "relay", "s"), fixed).start()


@pytest.mark.parametrize("request_bytes,code", [
    (b"GET /nope HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n", b"404"),
    (b"POST /status HTTP/1.1\r\nHost: localhost:1\r\nContent-Length: 0\r\n\r\n", b"405"),
    (b"GET /status HTTP/1.1\r\n\r\n", b"400"),  # HTTP/1.1 without Host
    (b"GARBAGE\r\n\r\n", b"400"),
    (b"GET /status\r\n\r\n", b"400"),
    (b"GET /status HTTP/1.1\r\nX: " + b"a" * 10_000 + b"\r\n\r\n", b"431"),
    (b"GET /status HTTP/1.1\r\n", b"400"),  # client half-closes mid-request
    (b"GET /status?verbose=1 HTTP/1.0\r\n\r\n", b"200"),
])
async def test_bad_requests_get_http_errors(request_bytes, code):
    async with AdminServer(NodeState("12D3KooWx", "relay", "s"), port=0) as server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(request_bytes)
        await writer.drain()
        writer.write_eof()
        reply = await asyncio.wait_for(reader.read(), 15)
        writer.close()
        assert reply.split(b" ")[1] == code
        assert b"Connection: close" in reply
        # The server still answers afterwards.
        assert (await aget(server.port, "/status"))[0] == 200


async def test_idle_client_does_not_block_others():
    async with AdminServer(NodeState("12D3KooWx", "relay", "s"), port=0) as server:
        _, idle = await asyncio.open_connection("127.0.0.1", server.port)  # sends nothing
        assert (await aget(server.port, "/status"))[0] == 200
        idle.close()


async def test_state_error_is_a_500_not_a_crash():
    state = NodeState("12D3KooWx", "relay", "s")

    class Broken:
        def connected_peers(self):
            raise RuntimeError("host closing")

    state.p2p = Broken()  # status() tolerates it
    async with AdminServer(state, port=0) as server:
        assert json.loads((await aget(server.port, "/status"))[2])["peers"] == []
        state.status = lambda: 1 / 0  # a bug in a role's state: the endpoint survives
        assert (await aget(server.port, "/status"))[0] == 500
        assert (await aget(server.port, "/metrics"))[0] == 200


# `swarm-node status` ------------------------------------------------------------------


class ServerThread:
    """An admin server on its own event loop in a thread, for synchronous clients."""

    def __init__(self, state, port_file):
        self.server = AdminServer(state, port=0, port_file=port_file)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self.server.start(), self.loop).result(10)
        return self.server

    def __exit__(self, *exc):
        asyncio.run_coroutine_threadsafe(self.server.close(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


def test_print_status_table_and_json(tmp_path, capsys):
    cfg = load_config(None, {"node.data_dir": str(tmp_path)})
    with ServerThread(make_state(), tmp_path / "admin.port"):
        assert find_port(cfg) == int((tmp_path / "admin.port").read_text())
        print_status(cfg)
        out = capsys.readouterr().out
        for text in (PEER, "demo", "trainer", "policy", "v3", "0.625", "rollouts accepted",
                     "bad_proof", "12D3KooWCheat", "2/5 shards", "yes"):
            assert text in out, text
        print_status(cfg, as_json=True)
        doc = json.loads(capsys.readouterr().out)
        assert doc["rollouts_rejected"]["bad_proof"] == 3


def test_print_status_prefers_node_json(tmp_path, capsys):
    cfg = load_config(None, {"node.data_dir": str(tmp_path)})
    (tmp_path / "admin.port").write_text("1\n")  # stale; node.json wins
    with ServerThread(make_state(), None) as server:
        (tmp_path / "node.json").write_text(json.dumps({"admin_port": server.port}))
        print_status(cfg, as_json=True)
        assert json.loads(capsys.readouterr().out)["peer_id"] == PEER
        print_status(cfg, port=server.port, as_json=True)  # explicit port
        assert json.loads(capsys.readouterr().out)["peer_id"] == PEER


def test_print_status_without_a_node(tmp_path):
    cfg = load_config(None, {"node.data_dir": str(tmp_path)})
    with pytest.raises(NodeError, match="no node is running") as e:
        print_status(cfg)
    assert str(tmp_path) in str(e.value)
    # A stale port file (node killed): nothing listens there.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    (tmp_path / "admin.port").write_text(f"{free}\n")
    with pytest.raises(NodeError, match=f"no node is answering on 127.0.0.1:{free}"):
        print_status(cfg)


def test_status_command_subprocess(tmp_path):
    binary = Path(sys.executable).parent / "swarm-node"
    env = {**os.environ, "HOME": str(tmp_path), "NO_COLOR": "1", "COLUMNS": "120"}
    none = subprocess.run([str(binary), "status", "--data-dir", str(tmp_path)],
                          capture_output=True, text=True, env=env, timeout=120, check=False)
    assert none.returncode == 1 and "no node is running" in none.stderr
    assert "Traceback" not in none.stderr
    with ServerThread(make_state(), tmp_path / "admin.port"):
        proc = subprocess.run([str(binary), "status", "--data-dir", str(tmp_path)],
                              capture_output=True, text=True, env=env, timeout=120, check=False)
        assert proc.returncode == 0, proc.stderr
        assert PEER in proc.stdout and "bad_proof" in proc.stdout
        proc = subprocess.run([str(binary), "status", "--data-dir", str(tmp_path), "--json"],
                              capture_output=True, text=True, env=env, timeout=120, check=False)
        assert json.loads(proc.stdout)["policy_version"] == 3


async def test_dashboard_page_and_versions_in_status(tmp_path):
    state = NodeState("12D3KooWx", "trainer", "s")
    state.software_version, state.protocol_version = "0.1.0", 1
    state.hardware = {"device": "cpu", "dtype": "float32", "backend": "hf"}
    state.record_step(1, 0.25, loss=0.5)
    state.observe("train_step_seconds", 0.3)
    state.own_verdicts.add("12D3KooWtrainer", False, "config_task_mix", 4, "round 0")
    async with AdminServer(state, port=0) as server:
        for path in ("/", "/dashboard"):
            code, ctype, body = await aget(server.port, path)
            assert code == 200 and ctype.startswith("text/html")
            assert b'id="curve"' in body and b'fetch("/status"' in body
        doc = json.loads((await aget(server.port, "/status"))[2])
        metrics = (await aget(server.port, "/metrics"))[2].decode()
    assert doc["software_version"] == "0.1.0" and doc["protocol_version"] == 1
    assert doc["runtime"]["device"] == "cpu"
    assert doc["steps"][0]["reward"] == 0.25 and doc["histograms"]["train_step_seconds"]["count"] == 1
    assert doc["verdicts_about_me"]["rejected"] == {"config_task_mix": 4}
    assert 'swarm_node_train_step_seconds_bucket{le="0.5"} 1.0' in metrics
    assert 'swarm_node_own_rollouts_rejected_total{reason="config_task_mix"} 4.0' in metrics


@pytest.mark.parametrize("host,code", [
    ("127.0.0.1", b"200"), ("localhost", b"200"), ("LOCALHOST:4010", b"200"),
    ("127.0.0.1:8080", b"200"), ("[::1]:4010", b"200"),
    ("attacker.example", b"403"), ("attacker.example:4010", b"403"),
    ("127.0.0.1.attacker.example", b"403"), ("localhost.attacker.example:80", b"403"),
    ("127.0.0.2", b"403"), ("localhost:80:80", b"403"), ("[::1]x", b"403"),
])
async def test_only_loopback_host_headers_are_answered(host, code):
    # DNS rebinding: a page from attacker.example, its name re-pointed at 127.0.0.1, sends
    # its own name as Host. Only loopback names are answered; the rest is counted.
    state = NodeState("12D3KooWx", "relay", "s")
    async with AdminServer(state, port=0) as server:
        for path in (b"/status", b"/metrics", b"/dashboard"):
            reply = await raw(server.port, b"GET " + path + b" HTTP/1.1\r\nHost: "
                              + host.encode() + b"\r\n\r\n")
            assert reply.split(b" ")[1] == code, (host, path)
            if code == b"403":
                assert b"peer_id" not in reply and b"12D3KooWx" not in reply
        refused = 3 if code == b"403" else 0
        assert server.refused_hosts == refused and state.counters["admin_host_refused"] == refused
        # two Host headers: refused whatever they say
        reply = await raw(server.port, b"GET /status HTTP/1.1\r\nHost: localhost\r\n"
                          b"Host: attacker.example\r\n\r\n")
        assert reply.split(b" ")[1] == b"403"
