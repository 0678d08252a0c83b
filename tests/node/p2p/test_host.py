"""P2PNode on real libp2p hosts over loopback: connect, requests, streams, shutdown."""

from __future__ import annotations

import asyncio
import os
import threading

import pytest
from swarm_node.node.p2p import P2PError, RequestError

from .conftest import PeerProcess, verdict, wait_until


async def test_two_processes_request_response_and_stream(make_node):
    peer = PeerProcess()
    try:
        info = await peer.ready()
        node = await make_node()
        remote = await node.connect(info["addrs"][0])
        assert remote == info["peer_id"]
        await wait_until(lambda: remote in node.connected_peers(), what="connection")

        assert await node.request(remote, "/test/echo/1.0.0", b"swarm") == b"mraws"
        big = os.urandom(300_000)
        assert await node.request(remote, "/test/echo/1.0.0", big) == big[::-1]

        stream = await node.open_stream(remote, "/test/raw-echo/1.0.0")
        blob = os.urandom(2 * 1024 * 1024 + 17)
        await stream.write(blob)
        echoed = await stream.readexactly(len(blob))
        await stream.close()
        assert echoed == blob
    finally:
        report = await peer.stop()
    assert peer.proc.returncode == 0
    assert report["shutdown_errors"] == [] and report["leftover_threads"] == []


async def test_request_failures_are_classified(make_node):
    server = await make_node(max_requests_per_peer=1, max_request_bytes=4096,
                             request_timeout_s=5)
    client = await make_node(bootstrap=server.listen_addrs)
    gate = asyncio.Event()

    async def slow(peer, body):
        await gate.wait()
        return b"late"

    async def broken(peer, body):
        raise ValueError("no such thing")

    async def echo(peer, body):
        return body

    await server.set_request_handler("/t/slow/1", slow)  # live once awaited
    await server.set_request_handler("/t/broken/1", broken)
    await server.set_request_handler("/t/echo/1", echo)

    with pytest.raises(RequestError) as e:
        await client.request(server.peer_id, "/t/echo/1", b"x" * 5000)
    assert e.value.reason == "too_large"
    with pytest.raises(RequestError) as e:
        await client.request(server.peer_id, "/t/broken/1", b"?")
    assert e.value.reason == "remote_error" and "no such thing" in str(e.value)
    with pytest.raises(RequestError) as e:
        await client.request(server.peer_id, "/t/unknown/1", b"?", timeout=3)
    assert e.value.reason == "open_failed"

    first = asyncio.create_task(client.request(server.peer_id, "/t/slow/1", b"1", timeout=10))
    await wait_until(lambda: server.requests._server_slots.inflight, what="first slow request")
    with pytest.raises(RequestError) as e:  # server allows one request per peer at a time
        await client.request(server.peer_id, "/t/slow/1", b"2")
    assert e.value.reason == "busy"
    gate.set()
    assert await first == b"late"

    gate.clear()
    with pytest.raises(RequestError) as e:
        await client.request(server.peer_id, "/t/slow/1", b"3", timeout=0.5)
    assert e.value.reason == "timeout"
    gate.set()
    assert await client.request(server.peer_id, "/t/echo/1", b"still fine") == b"still fine"
    assert server.metrics["requests_too_large"] == 1
    assert server.metrics["requests_busy"] == 1
    assert client.metrics["requests_failed"] == 5


async def test_close_leaves_no_threads(make_node):
    a = await make_node()
    b = await make_node(bootstrap=a.listen_addrs)
    await wait_until(lambda: a.connected_peers() == [b.peer_id], what="connection")
    await b.close()
    await a.close()
    names = [t.name for t in threading.enumerate()]
    assert not [n for n in names if n.startswith("p2p-") or "_background_cleanup" in n], names
    assert a.shutdown_errors == [] and b.shutdown_errors == []
    with pytest.raises(P2PError):
        await a.request(b.peer_id, "/t/echo/1", b"x")


async def test_bad_multiaddr_is_a_clear_error(make_node):
    node = await make_node()
    with pytest.raises(P2PError, match="lacks the /p2p/"):
        await node.connect("/ip4/127.0.0.1/tcp/4001")
    with pytest.raises(P2PError, match="not a valid multiaddr"):
        await node.connect("not-an-address")


async def test_close_under_load_is_clean(make_node):
    a = await make_node()
    b = await make_node(bootstrap=a.listen_addrs)
    got = []

    async def on_msg(env, peer):
        got.append(env.message.policy_version)

    async def echo(peer, body):
        return body

    a.set_request_handler("/t/echo/1", echo)
    await a.subscribe("verdicts", on_msg)
    await b.subscribe("verdicts", on_msg)
    await wait_until(lambda: b.gossip.mesh_peers("verdicts") == [a.peer_id], what="mesh")
    failures = []

    async def flood():
        for i in range(100_000):
            try:
                await b.publish("verdicts", verdict(i))
                await b.request(a.peer_id, "/t/echo/1", b"x" * 1000)
            except P2PError as e:
                failures.append(e)
                return

    task = asyncio.create_task(flood())
    await wait_until(lambda: len(got) > 20, what="traffic flowing")
    await b.close()  # mid-flood
    await asyncio.wait_for(task, 10)
    assert failures and all(isinstance(f, P2PError) for f in failures)
    assert b.shutdown_errors == []
    await a.close()
    assert a.shutdown_errors == []


async def test_subscribe_before_start_and_single_start(make_node):
    from swarm_node.node.identity import Identity
    from swarm_node.node.p2p import P2PNode

    from .conftest import p2p_config

    a = await make_node()
    got = []

    async def on_msg(env, peer):
        got.append((peer, env.message.policy_version))

    b = P2PNode(Identity.generate(), p2p_config())
    await b.subscribe("verdicts", on_msg)  # before start
    await b.start(bootstrap=a.listen_addrs)
    try:
        with pytest.raises(P2PError, match="already started"):
            await b.start()
        await wait_until(lambda: a.gossip.topic_peers("verdicts") == [b.peer_id], what="subscription")
        await a.publish("verdicts", verdict(5))
        await wait_until(lambda: got == [(a.peer_id, 5)], what="delivery")
    finally:
        await b.close()
