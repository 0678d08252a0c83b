"""Hostile peers around gossip bodies on the bulk plane (node/p2p/bodies.py), real hosts on
loopback: what a hostile server's answers cost the puller, and what a client that never
completes its hello can hold."""

from __future__ import annotations

import asyncio
import struct

import pytest
from swarm_node.node.p2p.bodies import KIND as BODY
from swarm_node.node.p2p.bodies import PullFailed
from swarm_node.node.p2p.bulk.cert import client_context
from swarm_node.node.p2p.bulk.hello import CHALLENGE_LEN, hello_frame

from .conftest import drop_warm_connection, wait_until
from .test_payload_plane import announce_of, batch


async def connected_pair(make_node, **p2p):
    p2p.setdefault("payload_push_fanout", 0)  # the pull path's bounds: no push links
    a = await make_node(**p2p)
    b = await make_node(bootstrap=a.listen_addrs, **p2p)
    await wait_until(lambda: a.peer_id in b.connected_peers(), 30, what="the connection")
    # every test here changes how a serves: b's pulls must open connections it handles
    await drop_warm_connection(b, a)
    return a, b


async def test_wrong_length_or_status_is_charged_to_the_source_not_retried(make_node):
    a, b = await connected_pair(make_node)
    body, ann, _ = announce_of(a, batch(a.peer_id, 8192, 1))
    a.gossip.body_server.lookup = lambda digest: body[:-1000]  # shorter than announced
    assert await b.gossip.fetch_payload(ann, a.peer_id, sources=[a.peer_id]) is None
    assert b.metrics["rejected.too_large"] == 1  # charged
    assert a.metrics["payload_bulk_served"] == 1  # asked once: no retry on a fresh connection

    async def odd_status(peer, conn):  # status 7: no such status
        await conn.readexactly(32)
        await conn.write(struct.pack(">BI", 7, ann.size))
        await conn.read(1)

    a.bulk.register(BODY, odd_status)
    assert await b.gossip.fetch_payload(ann, a.peer_id, sources=[a.peer_id]) is None
    assert b.metrics["rejected.too_large"] == 2
    assert b.penalties.score(a.peer_id) > 0


async def test_a_body_cut_short_is_a_broken_pull_not_an_offence(make_node):
    a, b = await connected_pair(make_node)
    body, ann, _ = announce_of(a, batch(a.peer_id, 8192, 1))

    async def truncated(peer, conn):  # the right header, half the body, then closed
        await conn.readexactly(32)
        await conn.write(struct.pack(">BI", 0, ann.size) + body[:len(body) // 2])

    a.bulk.register(BODY, truncated)
    with pytest.raises(PullFailed) as e:
        await b.gossip.puller.pull(a.peer_id, ann.content_hash, ann.size)
    assert e.value.reason == "broken"  # counted a miss where it happens, not charged
    assert b.metrics["rejected"] == 0 and b.penalties.score(a.peer_id) == 0


async def test_pulls_queued_behind_a_stalling_source_time_out_with_it(make_node):
    a, b = await connected_pair(make_node, payload_pull_timeout_s=1.0)
    _, ann, _ = announce_of(a, batch(a.peer_id, 8192, 1))
    asked = []

    async def stall(peer, conn):  # takes requests, never answers
        asked.append(await conn.readexactly(32))
        await conn.read(1)  # until the puller gives up

    a.bulk.register(BODY, stall)
    slots = b.cfg.payload_pulls_per_peer
    pulls = [b.gossip.puller.pull(a.peer_id, ann.content_hash, ann.size)
             for _ in range(2 * slots)]
    results = await asyncio.gather(*pulls, return_exceptions=True)
    assert all(isinstance(r, PullFailed) and r.reason == "timeout" for r in results)
    # those waiting for a connection timed out with the stalled ones, not a timeout later
    assert len(asked) == slots
    assert b.metrics["payload_bulk_slot_timeouts"] == slots


async def test_a_slow_hello_is_cut_and_holds_nothing(make_node):
    a, b = await connected_pair(make_node, bulk_handshake_timeout_s=0.5)
    port = a.bulk.bound[1]
    reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=client_context(),
                                                   server_hostname="")
    try:  # a valid hello, one byte every 0.1 s: cut at 0.5 s
        hello = hello_frame(b.identity, a.peer_id, BODY, await reader.readexactly(CHALLENGE_LEN))
        for i in range(len(hello)):
            writer.write(hello[i:i + 1])
            await writer.drain()
            if reader.at_eof():
                break
            await asyncio.sleep(0.1)  # the slow client's pace, not a wait for the server
        assert await asyncio.wait_for(reader.read(100), 10) == b""
    except (ConnectionError, OSError):
        pass
    finally:
        writer.transport.abort()
    assert a.metrics["bulk_handshake_timeout"] == 1
    assert a.metrics["bulk_authenticated"] == 1  # only b's warm-up
    assert not a.bulk.server.pending
