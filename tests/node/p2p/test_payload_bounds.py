"""Hostile peers on the payload plane (node/p2p/bodies.py), real hosts on loopback: what an
unauthenticated client can hold, and what a hostile server's answers cost the puller."""

from __future__ import annotations

import asyncio
import socket
import struct
import time

from swarm_node.node.config import P2PSection
from swarm_node.node.p2p.bodies import PayloadServer, PullFailed, TokenIssuer
from swarm_node.node.p2p.metrics import P2PMetrics
from swarm_node.node.p2p.tokens import CHALLENGE_LEN, hello_frame

from .conftest import challenge_of, drop_warm_connection, wait_until
from .test_payload_plane import announce_of, batch


async def connected_pair(make_node, **p2p):
    a = await make_node(**p2p)
    b = await make_node(bootstrap=a.listen_addrs, **p2p)
    await wait_until(lambda: a.peer_id in b.connected_peers(), 30, what="the connection")
    # every test here changes how a serves: b's pulls must open connections it handles
    await drop_warm_connection(b, a)
    return a, b


async def test_wrong_length_or_status_is_charged_to_the_source_not_retried(make_node):
    a, b = await connected_pair(make_node)
    body, ann, _ = announce_of(a, batch(a.peer_id, 8192, 1))
    a.gossip._server.lookup = lambda digest: body[:-1000]  # shorter than announced
    assert await b.gossip.fetch_payload(ann, a.peer_id, sources=[a.peer_id]) is None
    assert b.metrics["rejected.too_large"] == 1  # charged (it used to pass as "broken")
    assert a.metrics["payload_tcp_served"] == 1  # asked once: no retry on a fresh connection

    async def odd_status(peer, reader, writer):  # status 7: no such status
        await reader.readexactly(32)
        writer.write(struct.pack(">BI", 7, ann.size))
        await reader.read()

    a.gossip._server._serve = odd_status
    assert await b.gossip.fetch_payload(ann, a.peer_id, sources=[a.peer_id]) is None
    assert b.metrics["rejected.too_large"] == 2
    assert b.penalties.score(a.peer_id) > 0


async def test_pulls_queued_behind_a_stalling_source_time_out_with_it(make_node):
    a, b = await connected_pair(make_node, payload_pull_timeout_s=1.0)
    _, ann, _ = announce_of(a, batch(a.peer_id, 8192, 1))
    asked = []

    async def stall(peer, reader, writer):  # takes requests, never answers
        asked.append(await reader.readexactly(32))
        await reader.read()  # until the puller gives up

    a.gossip._server._serve = stall
    slots = b.cfg.payload_tcp_conns_per_peer
    pulls = [b.gossip._puller.pull(a.peer_id, ann.content_hash, ann.size)
             for _ in range(2 * slots)]
    results = await asyncio.gather(*pulls, return_exceptions=True)
    assert all(isinstance(r, PullFailed) and r.reason == "timeout" for r in results)
    # those waiting for a connection timed out with the stalled ones, not a timeout later
    assert len(asked) == slots
    assert b.metrics["payload_tcp_slot_timeouts"] == slots


async def test_unauthenticated_clients_cannot_hold_the_plane(make_node):
    a, b = await connected_pair(make_node, payload_tcp_max_pending=4,
                                payload_tcp_auth_timeout_s=0.5)
    port = a.gossip._server.port
    expiry = int((time.time() - 1) * 1000)  # a token of ours, for us, but expired
    mac = a.gossip._issuer.mac(b.peer_id, expiry)

    def expired(challenge: bytes) -> bytes:
        return hello_frame(b.peer_id, expiry, mac, challenge)

    def slow_loris() -> bytes:  # a valid hello, one byte every 0.1 s: cut at 0.5 s
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            hello = hello_frame(b.peer_id, *a.gossip._issuer.new(b.peer_id), challenge_of(s))
            try:
                for i in range(len(hello)):
                    s.sendall(hello[i:i + 1])
                    time.sleep(0.1)
                return s.recv(1)
            except (ConnectionResetError, BrokenPipeError):
                return b""

    def once(data) -> bytes:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(data(challenge_of(s)))
            try:
                return s.recv(1)
            except ConnectionResetError:
                return b""

    assert await asyncio.to_thread(once, expired) == b""
    assert await asyncio.to_thread(slow_loris) == b""
    assert a.metrics["payload_tcp_unauthenticated"] == 2
    # silent connections fill the unauthenticated slots: an honest pull still gets through
    # (the plane refuses it, so over libp2p), and nothing is served to the silent ones
    a.cfg.payload_tcp_auth_timeout_s = 30.0
    silent = [socket.create_connection(("127.0.0.1", port)) for _ in range(4)]
    try:
        await wait_until(lambda: a.gossip._server.pending == 4, 10, what="the slots held")
        body, ann, _ = announce_of(a, batch(a.peer_id, 8192, 1))
        a.gossip._store_payload(ann.content_hash, body)
        assert await b.gossip.fetch_payload(ann, a.peer_id, sources=[a.peer_id]) == body
        assert a.metrics["payload_tcp_refused_pending"] >= 1
        assert b.metrics["payload_pulled_libp2p"] == 1 and b.metrics["rejected"] == 0
    finally:
        for s in silent:
            s.close()
    await wait_until(lambda: a.gossip._server.pending == 0, 10, what="the slots freed")



async def test_authenticated_connections_are_capped_in_total_not_only_per_peer():
    cfg = P2PSection(payload_tcp_max_pending=2, payload_tcp_conns_per_peer=2)
    issuer, metrics = TokenIssuer("12D3KooWServer", 60), P2PMetrics()
    server = PayloadServer(issuer, lambda digest: None, lambda peer: True, cfg, metrics)
    port = await server.start("127.0.0.1", 0)
    conns = []

    async def connect(peer: str) -> bytes:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        conns.append(writer)
        challenge = await asyncio.wait_for(reader.readexactly(CHALLENGE_LEN), 10)
        writer.write(hello_frame(peer, *issuer.new(peer), challenge))
        try:
            return await asyncio.wait_for(reader.read(1), 10)
        except ConnectionResetError:
            return b""

    try:
        total = server.max_authenticated()  # 8: four peer ids, two connections each
        acks = [await connect(f"12D3KooWSybil{i // 2}") for i in range(total + 1)]
        assert acks == [b"\x01"] * total + [b""]  # a fresh id gets no ninth socket
        assert metrics["payload_tcp_refused_total"] == 1
        conns.pop(0).transport.abort()  # one ends: its place is free again
        await wait_until(lambda: sum(server.per_peer.values()) == total - 1, 10,
                         what="the place freed")
        assert await connect("12D3KooWHonest") == b"\x01"
    finally:
        for w in conns:
            w.transport.abort()
        await server.close()
