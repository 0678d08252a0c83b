"""Reachability verdicts: the tracker's rules (unit), and the dial-back check on real hosts."""

from __future__ import annotations

from prometheus_client import generate_latest
from swarm_node.node.identity import Identity
from swarm_node.node.metrics import NodeState
from swarm_node.node.p2p import P2PNode
from swarm_node.node.p2p.reachability import ReachabilityTracker, Verdict

from .conftest import p2p_config, wait_until


def test_tracker_verdicts_and_listeners():
    tracker = ReachabilityTracker()
    seen: list[Verdict] = []
    unsubscribe = tracker.subscribe(lambda snap: seen.append(snap.verdict))
    assert tracker.current.verdict is Verdict.UNKNOWN and not tracker.current.public
    tracker.set_dialback(False, [], "1 of 1 dial-backs failed")
    assert tracker.current.verdict is Verdict.UNREACHABLE
    tracker.set_relay_addrs(["/ip4/1.2.3.4/tcp/4001/p2p/Qm/p2p-circuit/p2p/Qx"])
    assert tracker.current.verdict is Verdict.RELAYED
    tracker.set_direct_peers(1)
    assert tracker.current.verdict is Verdict.DIRECT
    tracker.set_direct_peers(2)  # same verdict: no call
    tracker.set_dialback(True, ["/ip4/1.2.3.4/tcp/4001"])
    assert tracker.current.public and tracker.current.public_addrs
    assert seen == [Verdict.UNREACHABLE, Verdict.RELAYED, Verdict.DIRECT, Verdict.PUBLIC]
    unsubscribe()
    tracker.set_dialback(False, [])
    assert len(seen) == 4
    assert "relay" in tracker.current.line() and tracker.current.as_dict()["verdict"] == "direct"


async def test_public_on_loopback(make_node):
    boot = await make_node()
    node = await make_node(bootstrap=boot.listen_addrs)
    await wait_until(lambda: node.reachability.verdict is not Verdict.UNKNOWN, 20,
                     what="a verdict")
    snap = node.reachability
    assert snap.public, snap.line()
    port = node.listen_addrs[0].split("/tcp/")[1].split("/")[0]
    assert snap.public_addrs == (f"/ip4/127.0.0.1/tcp/{port}",)
    assert node.health()["reachability"]["verdict"] == "public"
    state = NodeState(peer_id=node.peer_id, role="inference", swarm_id="default")
    state.attach_transport(node)
    text = generate_latest(state.registry).decode()
    assert 'swarm_node_reachability{verdict="public"} 1.0' in text
    assert 'swarm_node_reachability{verdict="unreachable"} 0.0' in text
    assert 'swarm_node_p2p_connections{kind="open"} 1.0' in text


async def test_private_when_dial_back_fails(make_node):
    """Listening on 127.0.0.2 while dialling out from 127.0.0.1 is a NAT in miniature: the
    peer sees us at 127.0.0.1, where nothing listens."""
    boot = await make_node()
    cfg = p2p_config().with_overrides({"node.listen": ["/ip4/127.0.0.2/tcp/0"]})
    node = P2PNode(Identity.generate(), cfg)
    seen = []
    node.on_reachability_change(seen.append)
    await node.start(bootstrap=boot.listen_addrs)
    try:
        await wait_until(lambda: seen, 20, what="a verdict")
        snap = node.reachability
        assert snap.verdict is Verdict.UNREACHABLE, snap.line()
        assert not snap.public_addrs and "connection refused" in snap.detail
        assert snap.observed_addrs and snap.observed_addrs[0].startswith("/ip4/127.0.0.1/")
    finally:
        await node.close()


def test_why_not_py_libp2p_autonat():
    """py-libp2p 0.8.1's AutoNAT server dials back with `host.connect`, which returns at
    once over the connection the request came on: a closed port is reported reachable.
    When this fails, upstream fixed it and AutoNAT could replace dialback.py."""
    import socket

    import multiaddr
    import trio
    from libp2p.host.autonat import AutoNATService
    from libp2p.host.autonat.pb.autonat_pb2 import Message
    from libp2p.peer.peerinfo import PeerInfo

    from .patches.rawhost import raw_host, running

    async def ask() -> int:
        a, b = raw_host(), raw_host()
        async with running(a, b):
            AutoNATService(b)  # the server
            await a.connect(PeerInfo(b.get_id(), b.get_addrs()))
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            closed = multiaddr.Multiaddr(f"/ip4/127.0.0.1/tcp/{s.getsockname()[1]}")
            s.close()
            status, _ = await AutoNATService(a, serve=False).query_server(
                b.get_id(), [closed.to_bytes()])
            return status

    assert trio.run(ask) == Message.OK


def test_peer_reach_kinds_from_connections_adverts_and_probes():
    from swarm_node.node.p2p.reachability import peer_reach

    circuit = "/ip4/1.2.3.4/tcp/4001/p2p/R/p2p-circuit/p2p/"
    kinds = peer_reach(
        connected={"pub", "dialled", "punched", "natdirect", "relayed", "inbound"},
        relayed={"relayed"}, outbound={"dialled", "punched"}, punched={"punched"},
        advertised={"natdirect": [circuit + "natdirect"], "relayed": [circuit + "relayed"],
                    "away": [circuit + "away"], "pub": ["/ip4/1.2.3.4/tcp/1/p2p/pub"]},
        probed={"pub": (True, ""), "nat": (False, "timeout"), "inbound": (False, "refused")})
    got = {peer: kind for peer, (kind, _why) in kinds.items()}
    assert got == {"pub": "public", "dialled": "public", "punched": "hole-punched",
                   "natdirect": "hole-punched", "relayed": "relayed", "away": "relayed",
                   "nat": "unreachable", "inbound": "unreachable"}
    assert "timeout" in kinds["nat"][1] and list(kinds)[:6] == sorted(
        ["pub", "dialled", "punched", "natdirect", "relayed", "inbound"])  # connected first
    assert peer_reach(connected={"x"}, relayed=set(), outbound=set(), punched=set(),
                      advertised={}, probed={})["x"][0] == "?"  # it dialled us: nothing known


async def test_peers_see_who_is_public_and_who_cannot_be_dialled(make_node):
    """Real hosts: `pub` listens where it dials from; `nat` listens on 127.0.0.2 and dials
    from 127.0.0.1 (a NAT in miniature). The bootstrap peer answers both dial-back checks,
    so its /status says which of them it could dial back; and each of them dialled it. The
    NAT'd one runs as a relay: its role comes from its Hello."""
    boot = await make_node()
    pub = await make_node(bootstrap=boot.listen_addrs)
    cfg = p2p_config({"role": "relay"}).with_overrides(
        {"node.listen": ["/ip4/127.0.0.2/tcp/0"]})
    nat = P2PNode(Identity.generate(), cfg)
    await nat.start(bootstrap=boot.listen_addrs)
    try:
        def kind(node, peer) -> str:
            return (node.health()["peer_reach"].get(peer) or ["", ""])[0]

        await wait_until(lambda: kind(boot, pub.peer_id) == "public"
                         and kind(boot, nat.peer_id) == "unreachable", 20,
                         what="the bootstrap peer's dial-back verdicts about both peers")
        why = boot.health()["peer_reach"][nat.peer_id][1]
        assert "dial-back probe failed (connection refused)" in why, why
        assert kind(nat, boot.peer_id) == "public"  # it dialled the bootstrap peer directly
        state = NodeState(peer_id=boot.peer_id, role="relay", swarm_id="default")
        state.attach_transport(boot)
        from swarm_node.node.admin import status_document

        rows = {r["peer"]: r for r in status_document(state)["swarm"]["peers"]}
        assert rows[pub.peer_id]["reach"] == "public", rows
        assert rows[nat.peer_id]["reach"] == "unreachable", rows
        # and the role each named in its Hello (nothing else tells a relay from a peer)
        assert boot.health()["peer_roles"] == {pub.peer_id: "inference", nat.peer_id: "relay"}
        assert rows[nat.peer_id]["role"] == "relay" and rows[pub.peer_id]["role"] == "inference"
    finally:
        await nat.close()
