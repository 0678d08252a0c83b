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
    """Stands in for the views of P2PNode the state reads (metrics.Transport; logic test)."""

    def __init__(self, peers):
        self.peers = peers
        self.metrics = type("M", (), {"counters": {"published": 5, "rejected.stale": 2}})()

    def connected_peers(self):
        return self.peers

    def health(self):
        return {"ok": True}


def make_state() -> NodeState:
    st = NodeState(peer_id=PEER, role="trainer", swarm_id="demo")
    st.attach_transport(FakeP2P(["12D3KooWA", "12D3KooWB"]))
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
        metrics = None  # its counters break too

        def connected_peers(self):
            raise RuntimeError("host closing")

        def health(self):
            raise RuntimeError("host closing")

    state.attach_transport(Broken())  # status() tolerates it
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
    # the node.json of a node that stopped (its process is gone): said as such
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    (tmp_path / "node.json").write_text(json.dumps({"pid": int(gone), "role": "relay",
                                                    "admin_port": free}))
    with pytest.raises(NodeError, match=f"the relay node with data dir {tmp_path} is not "
                                        f"running \\(its last process, pid {gone}, has exited"):
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
        assert state.counters["admin_host_refused"] == refused
        # two Host headers: refused whatever they say
        reply = await raw(server.port, b"GET /status HTTP/1.1\r\nHost: localhost\r\n"
                          b"Host: attacker.example\r\n\r\n")
        assert reply.split(b" ")[1] == b"403"


# alerts, contribution, role-aware tables, history -------------------------------------


def test_status_tables_are_role_aware_and_lead_with_what_needs_attention():
    from rich.console import Console
    from swarm_node.node.admin import render_tables, status_document

    peer = NodeState("12D3KooWInference", "inference", "demo")
    peer.policy_id, peer.policy_version, peer.rollouts_sent = "12D3KooWTrainerOfTheSwarm", 43, 96
    peer.own_verdicts.add("12D3KooWTrainerOfTheSwarm", True, "accepted", 64)
    peer.own_verdicts.swarm_summary("12D3KooWTrainerOfTheSwarm", 64)
    peer.own_verdicts.swarm_summary("12D3KooWTrainerOfTheSwarm", 192)  # another peer's
    peer.extra["settings"] = {"refused": "refusing the policy of trainer heSwarm: its swarm "
                                         "settings differ: sampler.temperature = 0.5 here"}
    doc = json.loads(json.dumps(status_document(peer), default=str))
    assert [a["code"] for a in doc["alerts"]] == ["settings_refused"]
    assert doc["contribution"]["trainers"][0]["share"] == 0.25  # 64 of the 256 it accepted
    console = Console(width=160, record=True)
    for table in render_tables(doc):
        console.print(table)
    out = console.export_text()
    assert out.index("NEEDS ATTENTION") < out.index("swarm-node inference")
    assert "sampler.temperature = 0.5 here" in out and "remove the differing" in out
    assert "heSwarm v43" in out  # not "policy -" beside a checkpoint
    assert "accepted by trainers" in out and "25.0%" in out
    assert "rollouts accepted" not in out  # the trainer's row ("accepted here") is not shown

    relay = NodeState("12D3KooWRelay", "relay", "demo")
    relay.count("versions_mirrored", 16)
    relay.record_served("12D3KooWa", 3 * 2**20)
    relay.record_served("12D3KooWb", 2**20)
    console = Console(width=160, record=True)
    for table in render_tables(status_document(relay)):
        console.print(table)
    out = console.export_text()
    assert "16 versions mirrored" in out and "served 4.0 MiB to 2 peers" in out
    assert "NEEDS ATTENTION" not in out and "reward" not in out


def test_alerts_from_each_stuck_state():
    from swarm_node.node.dashboard.views import alerts

    def codes(**doc):
        return [a["code"] for a in alerts(doc)]

    assert codes(role="inference") == []
    assert codes(p2p={"alive": False, "failure": "trio died"}) == ["host_failed"]
    assert codes(verdicts_about_me={"banned_by": {"12D3KooWT": {"detail": "x"}}}) == ["banned"]
    assert codes(verdicts_about_me={"rejected": {"config_task_mix": 8, "proof_length": 1}}) \
        == ["settings_differ"]
    assert codes(extra={"follow": {"trainer": "T", "seen": False, "problem": "p"}}) \
        == ["nothing_to_follow"]
    assert codes(extra={"follow": {"trainer": "T", "seen": True}}) == []
    assert codes(extra={"disk": {"paused": True, "path": "/d", "name": "downloads",
                                 "min_free_bytes": 256 * 2**20}}) == ["disk_paused:disk"]
    for reach in ("unreachable", {"status": "unreachable", "hint": "open TCP 4001"},
                  {"state": "Unreachable (no relay)"}):
        assert codes(reachability=reach) == ["unreachable"]
        assert codes(p2p={"alive": True, "reachability": reach}) == ["unreachable"]
    assert codes(reachability={"status": "public"}) == []
    assert codes(problems={"x": {"title": "t", "level": "error"}}) == ["x"]
    fix = alerts({"reachability": {"status": "unreachable", "hint": "open TCP 4001"}})[0]["fix"]
    assert fix == "open TCP 4001"


def test_download_progress_has_a_rate_and_an_eta(monkeypatch):
    from swarm_node.node import metrics

    clock = [100.0]
    monkeypatch.setattr(metrics.time, "monotonic", lambda: clock[0])
    st = NodeState("12D3KooWx", "relay", "s")
    st.set_checkpoint_progress(5, 0, 10, 0, 100 * 2**20)
    assert st.checkpoint_progress["eta_s"] is None  # no rate yet
    clock[0] += 4.0
    st.set_checkpoint_progress(5, 2, 10, 20 * 2**20, 100 * 2**20)
    assert st.checkpoint_progress["rate_bytes_s"] == 5 * 2**20
    assert st.checkpoint_progress["eta_s"] == 16.0
    st.set_checkpoint_progress(6, 0, 10, 0, 100 * 2**20)  # a new version starts over
    assert st.checkpoint_progress["eta_s"] is None


def test_history_round_trip_and_a_bad_file(tmp_path):
    from swarm_node.node.metrics import HISTORY, load_history, save_history

    st = make_state()
    for v in range(HISTORY + 20):
        st.record_step(v, 0.1, loss=0.5, tokens_per_s=100.0)
    st.reward_history.extend((v, 0.1) for v in range(3))
    st.record_download(2, "12D3KooWT", 1000, None)
    st.own_verdicts.add("12D3KooWT", True, "accepted", 8)
    st.record_served("12D3KooWA", 4096)
    path = tmp_path / "history.json"
    save_history(st, path)

    again = NodeState(PEER, "trainer", "demo")
    assert "history restored" in load_history(again, path)
    doc = again.status()
    assert len(doc["steps"]) == HISTORY and doc["steps"][-1]["version"] == HISTORY + 19
    assert doc["accepted_by_peer"]["12D3KooWCheat"]["reasons"] == {"bad_proof": 3,
                                                                  "bad_logprobs": 1}
    assert doc["rollouts_accepted"] == 8 and doc["rollouts_sent"] == 12
    assert doc["counters"]["train_steps"] == 3 and doc["counters"]["bytes_downloaded"] == 1000
    assert doc["verdicts_about_me"]["accepted"] == 8 and doc["served"] == {"bytes": 4096,
                                                                           "peers": 1}
    assert [list(p) for p in doc["reward_history"]] == [[0, 0.1], [1, 0.1], [2, 0.1]]
    assert doc["reward"] == 0.1
    # a history that cannot be used is left aside with a note, never fatal
    for bad in ("{not json", json.dumps({"version": 99}), json.dumps([1, 2]),
                json.dumps({"version": 1, "steps": 5, "reward_history": [["x", 1]]})):
        path.write_text(bad)
        assert "not used" in load_history(NodeState(PEER, "trainer", "demo"), path)
    assert load_history(NodeState(PEER, "trainer", "demo"), tmp_path / "none.json") == ""


def test_join_command_is_complete():
    from swarm_node.node.runner import join_command

    cfg = load_config(None, {"node.swarm_id": "my-swarm"})
    addrs = ["/ip4/127.0.0.1/tcp/4001/p2p/12D3KooWme", "/ip4/203.0.113.7/tcp/4001/p2p/12D3KooWme"]
    line = join_command(cfg, addrs, "12D3KooWtrainer")
    assert line == ("swarm-node join --role inference --swarm my-swarm --bootstrap "
                    "/ip4/203.0.113.7/tcp/4001/p2p/12D3KooWme --follow 12D3KooWtrainer")
    assert "--follow" not in join_command(cfg, addrs[:1], None)  # a relay that knows no trainer
    assert join_command(cfg, [], "x") == ""


def test_join_command_behind_nat_names_an_address_others_can_dial():
    from swarm_node.node.p2p.reachability import Reachability, Verdict
    from swarm_node.node.runner import join_command

    boot = "/ip4/203.0.113.7/tcp/4001/p2p/12D3KooWboot"
    cfg = load_config(None, {"node.swarm_id": "s", "node.bootstrap": [boot]})
    lan = ["/ip4/192.168.1.10/tcp/4001/p2p/12D3KooWme"]
    circuit = f"{boot}/p2p-circuit/p2p/12D3KooWme"
    relayed = Reachability(verdict=Verdict.RELAYED, relay_addrs=(circuit,))
    assert f"--bootstrap {circuit} " in join_command(cfg, lan, "t", reach=relayed)
    # nobody can dial it: the line names the peer it joined through
    alone = Reachability(verdict=Verdict.UNREACHABLE)
    assert f"--bootstrap {boot} " in join_command(cfg, lan, "t", reach=alone)
    for reach in (None, Reachability(), Reachability(verdict=Verdict.PUBLIC)):
        assert f"--bootstrap {lan[0]} " in join_command(cfg, lan, "t", reach=reach)


def test_join_command_names_a_dialable_address_when_listening_on_every_interface():
    from swarm_node.node.runner import join_command, route_ip

    loop = ["/ip4/127.0.0.1/tcp/4001/p2p/12D3KooWme"]
    every = load_config(None, {"node.swarm_id": "s", "node.listen": ["/ip4/0.0.0.0/tcp/4001"]})
    # 0.0.0.0 expanded to loopback only (the host name resolves to 127.x): the line names
    # the default route's address, which another machine can dial
    line = join_command(every, loop, None, route_ip=lambda: "192.0.2.2")
    assert "--bootstrap /ip4/192.0.2.2/tcp/4001/p2p/12D3KooWme" in line
    assert "127.0.0.1" in join_command(every, loop, None, route_ip=lambda: None)  # no route
    # a node that listens on loopback only is joined on loopback (one-machine tests)
    local = load_config(None, {"node.swarm_id": "s", "node.listen": ["/ip4/127.0.0.1/tcp/0"]})
    assert "/ip4/127.0.0.1/" in join_command(local, loop, None, route_ip=lambda: "192.0.2.2")
    # the real lookup: an address of this machine that is not loopback, or none at all
    ip = route_ip()
    assert ip is None or (not ip.startswith("127.") and ip.count(".") == 3)


def test_the_training_step_in_progress_has_what_it_waits_for_and_an_eta():
    from rich.console import Console
    from swarm_node.node.admin import render_tables, status_document
    from swarm_node.node.trainer.progress import StepProgress

    clock, held = [100.0], [1, 0]
    p = StepProgress((4, 4), lambda: tuple(held), version=7, clock=lambda: clock[0])
    st = NodeState("12D3KooWTrainer", "trainer", "s")
    st.extra["step"] = p.view
    st.metrics.before_read(p.refresh)
    batches = [0]
    p.set("waiting_for_peers", lambda: f"waiting for rollout batches from peers: "
                                       f"{batches[0]} of 2 verified")
    clock[0] += 3.0
    batches[0] = 1
    step = status_document(st)["extra"]["step"]
    assert step["phase"] == "waiting_for_peers" and step["phase_s"] == 3.0
    assert step["doing"].endswith("1 of 2 verified") and step["next_version"] == 8
    assert step["groups"] == {"local": 1, "external": 0, "need_local": 4, "need_external": 4}
    assert step["eta_s"] is None  # no pace before two versions
    for _ in range(3):  # versions every 10 s
        clock[0] += 10.0
        p.stepped(p.version + 1)
    clock[0] += 4.0
    step = status_document(st)["extra"]["step"]
    assert step["pace_s"] == 10.0 and step["eta_s"] == 6.0 and step["next_version"] == 11
    console = Console(width=200, record=True)
    for table in render_tables(json.loads(json.dumps(status_document(st), default=str))):
        console.print(table)
    out = console.export_text()
    assert "training step" in out and "v11: waiting for rollout batches" in out
    assert "groups 1/4 of this policy, 0/4 of others; due in 6 s" in out
    held[:] = [17, 0]  # more groups wait than a step takes: the rest go to the next steps
    console = Console(width=200, record=True)
    for table in render_tables(json.loads(json.dumps(status_document(st), default=str))):
        console.print(table)
    assert "groups 4/4 (+13 waiting) of this policy, 0/4 of others" in console.export_text()
    clock[0] += 60.0
    assert status_document(st)["extra"]["step"]["eta_s"] == 0.0  # overdue: due now


def test_the_swarm_view_joins_connections_adverts_and_counts():
    from rich.console import Console
    from swarm_node.node.admin import render_tables, status_document
    from swarm_node.node.dashboard.views import swarm

    T, R, P, Q = "12D3KooWTrainer", "12D3KooWRelay", "12D3KooWPeer", "12D3KooWQuiet"
    doc = {"peer_id": "12D3KooWMe", "role": "inference", "policy_id": T, "peers": [T, R, Q],
           "p2p": {"connections": {"relayed_peers": [R]},
                   "peer_reach": {T: ["public", "this node dialled it directly"],
                                  R: ["relayed", "connected only through a relay"]},
                   "peer_roles": {R: "relay", T: "inference"}},
           "extra": {"swarm": {
               "versions": [{"policy_id": T, "version": 5, "holders": 2, "here": "complete"},
                            {"policy_id": T, "version": 6, "holders": 1, "here": ""}],
               "holders": {T: {"policy_id": T, "version": 6, "complete": True},
                           R: {"policy_id": T, "version": 5, "complete": True},
                           P: {"policy_id": T, "version": 6, "complete": False}}}}}
    view = swarm(doc)
    rows = {r["peer"]: r for r in view["peers"]}
    assert rows[T] == {"peer": T, "role": "trainer", "version": 6, "complete": True,
                       "connection": "direct", "reach": "public",
                       "reach_why": "this node dialled it directly"}
    assert rows[R]["reach"] == "relayed" and rows[Q]["reach"] == "?"
    assert rows[R]["role"] == "relay" and rows[R]["connection"] == "relayed"  # its Hello
    assert rows[P]["connection"] == "not connected" and rows[P]["complete"] is False
    assert rows[Q]["role"] == "?" and rows[Q]["version"] is None
    assert view["peers_known"] == 4 and view["versions"][0]["here"] == "complete"
    assert [r["peer"] for r in view["peers"]][-1] == P  # connected peers first

    # a trainer: the peers it verified, with their counts
    st = NodeState("12D3KooWMe", "trainer", "s")
    st.accept(P, 12)
    st.reject(P, "proof_length", 3)
    out = status_document(st)
    assert out["swarm"]["peers"] == [{"peer": P, "role": "inference", "version": None,
                                      "complete": None, "connection": "not connected",
                                      "reach": "?", "reach_why": "not known from here",
                                      "accepted": 12, "rejected": 3}]
    console = Console(width=200, record=True)
    for table in render_tables(json.loads(json.dumps(out, default=str))):
        console.print(table)
    text = console.export_text()
    assert "the swarm as this node knows it (1 peers)" in text and "inference" in text
    assert "reachable" in text
