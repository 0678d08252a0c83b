"""Announced gossip bodies over the bulk plane (node/p2p/bodies.py): pulled over TLS,
checked against the signed announce, with fallbacks and penalties. Real libp2p hosts on
loopback; bad servers are real nodes whose serving is altered."""

from __future__ import annotations

import asyncio
import hashlib

import numpy as np
import pytest
from swarm_node.node.p2p.bodies import KIND as BODY
from swarm_node.node.p2p.pubsub import HEDGE_FACTOR
from swarm_node.protocol.messages import PayloadAnnounce, RolloutBatch

from .conftest import drop_warm_connection, one_completion_batch, wait_until

KIND = "rollouts"


def batch(policy_id: str, n_tokens: int, round_: int) -> RolloutBatch:
    return one_completion_batch(policy_id, np.arange(n_tokens, dtype=np.int32) % 1000,
                                np.full(n_tokens, -0.5, dtype=np.float32), round_)


async def pair(make_node, **p2p):
    """Two meshed nodes subscribed to KIND; returns (a, b, messages a received). These
    tests are of the pull path: publishers push nothing unless a test says so."""
    p2p.setdefault("payload_push_fanout", 0)
    return await meshed(make_node, **p2p)


async def meshed(make_node, **p2p):
    """Two nodes with these p2p settings, subscribed to KIND and in each other's mesh;
    (a, b, messages a and b received)."""
    a = await make_node(**p2p)
    b = await make_node(bootstrap=a.listen_addrs, **p2p)
    got = []

    async def on_msg(env, peer):
        got.append((peer, env))

    await a.subscribe(KIND, on_msg)
    await b.subscribe(KIND, on_msg)
    await wait_until(lambda: b.peer_id in a.gossip.mesh_peers(KIND) and a.peer_id in b.gossip.mesh_peers(KIND),
                     30, what="the mesh")
    return a, b, got


def announce_of(node, message) -> tuple[bytes, PayloadAnnounce, bytes]:
    """(sealed body, its announce, the sealed announce) as `publish` would make them."""
    body = node.identity.seal(message)
    ann = PayloadAnnounce(inner_type=message.TYPE, content_hash=hashlib.sha256(body).digest(),
                          size=len(body))
    return body, ann, node.identity.seal(ann)


async def test_large_payload_pulled_over_the_bulk_plane_small_stays_inline(make_node):
    a, b, got = await pair(make_node)
    large, small = batch(b.peer_id, 8192, 1), batch(b.peer_id, 100, 2)  # ~64 KiB, ~1 KiB
    await b.publish(KIND, large)  # above the 16 KiB inline default: announced
    await b.publish(KIND, small)  # inline
    await wait_until(lambda: len(got) == 2, 30, what="both batches")
    assert {env.message.round: env.message for _, env in got} == {1: large, 2: small}
    assert b.metrics["payload_announced"] == 1
    assert a.metrics["payload_pulled_bulk"] == 1 and a.metrics["payload_pulled_libp2p"] == 0
    assert b.metrics["payload_bulk_served"] == 1
    assert a.metrics["rejected"] == 0


async def test_a_new_connection_warms_the_plane_so_the_first_pull_needs_no_query(make_node):
    a, b, got = await pair(make_node)
    # each side asked the other's endpoint and opened one connection when they connected
    await wait_until(lambda: a.metrics["payload_bulk_warmed"] == 1
                     and b.metrics["payload_bulk_warmed"] == 1, 10, what="the warm-ups")
    asked = []
    query = a.bulk.client.query

    async def counted(peer):
        asked.append(peer)
        return await query(peer)

    a.bulk.client.query = counted
    await b.publish(KIND, batch(b.peer_id, 8192, 1))  # announced
    await wait_until(lambda: len(got) == 1, 30, what="the batch")
    assert a.metrics["payload_pulled_bulk"] == 1 and asked == []
    assert a.bulk.client.opened[f"{BODY}_reused"] == 1  # on the warmed connection
    assert b.metrics["payload_bulk_served"] == 1


async def test_a_failed_warm_up_marks_nothing_down(make_node):
    a = await make_node(bulk_listen="off")  # no plane: its endpoint query answers none
    b = await make_node(bootstrap=a.listen_addrs)
    await wait_until(lambda: b.metrics["payload_bulk_warm_failed"] == 1, 10,
                     what="b's failed warm-up")
    assert b.metrics["payload_bulk_warmed"] == 0
    assert b.gossip.puller.usable(a.peer_id)  # the first pull decides, not the warm-up
    # b serves a plane: a warmed to it
    await wait_until(lambda: a.metrics["payload_bulk_warmed"] == 1, 10, what="a's warm-up")


async def test_a_warm_up_to_an_endpoint_that_does_not_answer_marks_it_down(make_node):
    a = await make_node()
    b = await make_node(bootstrap=a.listen_addrs, bulk_advertise="127.0.0.1:9")  # nobody
    await wait_until(lambda: a.metrics["payload_bulk_warm_failed"] == 1, 10,
                     what="a's failed warm-up")
    assert not a.gossip.puller.usable(b.peer_id)  # the first pull goes over libp2p at once


async def test_body_that_does_not_match_its_announce_is_rejected(make_node):
    a, b, got = await pair(make_node)
    body, ann, sealed_ann = announce_of(b, batch(b.peer_id, 8192, 1))
    forged = bytearray(body)
    forged[-1] ^= 1
    b.gossip.store_payload(ann.content_hash, bytes(forged))  # serves other bytes than announced
    await b.gossip.publish_raw(KIND, sealed_ann)
    await wait_until(lambda: a.metrics["payload_fetch_failed"] == 1, 30, what="the failed pull")
    assert a.metrics["rejected.hash_mismatch"] == 1
    assert a.penalties.score(b.peer_id) > 0
    assert got == [] and a.metrics["payload_fetched"] == 0


async def test_announcer_that_never_serves_is_counted_and_penalised(make_node):
    a, b, got = await pair(make_node)
    _, _, sealed_ann = announce_of(b, batch(b.peer_id, 8192, 1))
    await b.gossip.publish_raw(KIND, sealed_ann)  # announced, never stored
    await wait_until(lambda: a.metrics["payload_fetch_failed"] == 1, 30, what="the failed pull")
    assert a.metrics["rejected.unserved_announce"] == 1
    assert b.metrics["payload_bulk_not_held"] == 1  # asked over the plane: "not held"
    assert a.penalties.score(b.peer_id) > 0
    assert got == []


async def test_pull_falls_back_to_another_holder_over_libp2p(make_node, caplog):
    a = await make_node()  # the announcer: holds nothing
    c = await make_node(bootstrap=a.listen_addrs, bulk_listen="off")  # holds it
    b = await make_node(bootstrap=a.listen_addrs)
    await wait_until(lambda: {a.peer_id, c.peer_id} <= set(b.connected_peers()), 30,
                     what="b connected to a and c")
    body, ann, _ = announce_of(a, batch(a.peer_id, 8192, 1))
    c.gossip.store_payload(ann.content_hash, body)
    with caplog.at_level("INFO", logger="swarm_node.node.p2p.bulk.client"):
        data = await b.gossip.fetch_payload(ann, a.peer_id, sources=[a.peer_id, c.peer_id])
    assert data == body
    assert b.metrics["rejected.unserved_announce"] == 1  # a over the plane: not held
    assert b.metrics["payload_pulled_libp2p"] == 1  # c has no plane: libp2p
    assert not b.gossip.puller.usable(c.peer_id)
    said = [r.message for r in caplog.records if c.peer_id[-8:] in r.message]
    assert len(said) == 1 and "over libp2p streams" in said[0]  # one line for that source


async def test_a_forwarder_still_pulling_is_asked_again(make_node):
    """Announces travel ahead of their bodies: the peer that forwarded one may not hold the
    body yet when we ask. It is asked again shortly (no offence), not given up on."""
    a = await make_node()  # the announcer: reachable only through c (not asked here)
    c = await make_node(bootstrap=a.listen_addrs)  # the forwarder, pulling it itself
    b = await make_node(bootstrap=c.listen_addrs)
    await wait_until(lambda: c.peer_id in b.connected_peers(), 30, what="b connected to c")
    body, ann, _ = announce_of(a, batch(a.peer_id, 8192, 1))
    asked = asyncio.Event()
    lookup = c.gossip.body_server.lookup

    def not_yet(digest):  # the first ask finds nothing, then c holds it
        if not asked.is_set():
            asked.set()
            asyncio.get_running_loop().call_later(0.2, c.gossip.store_payload,
                                                  ann.content_hash, body)
        return lookup(digest)

    c.gossip.body_server.lookup = not_yet
    assert await b.gossip.fetch_payload(ann, a.peer_id, sources=[c.peer_id]) == body
    assert b.metrics["payload_pull_retries"] >= 1 and b.metrics["payload_pull_misses"] >= 1
    assert b.metrics["rejected"] == 0 and b.penalties.score(c.peer_id) == 0


async def test_more_peers_are_asked_while_the_first_ones_do_not_hold_it(make_node):
    """Besides the announcer and its forwarder, 3 other peers are asked at first; while none
    holds the body, 3 more are asked each time (the peers that pulled it may be any)."""
    b = await make_node()
    a, *others = [await make_node(bootstrap=b.listen_addrs) for _ in range(5)]
    await wait_until(lambda: len(b.connected_peers()) == 5, 30, what="b connected to all")
    first = b.gossip.pull_sources(a.peer_id)  # a (holds nothing) and 3 others
    holder = next(o for o in others if o.peer_id not in first)
    body, ann, _ = announce_of(a, batch(a.peer_id, 8192, 1))
    holder.gossip.store_payload(ann.content_hash, body)
    assert await b.gossip.fetch_payload(ann, a.peer_id) == body
    assert b.metrics["payload_pull_retries"] >= 1


async def test_a_direct_holder_is_asked_before_a_relayed_announcer(make_node, monkeypatch):
    """An announcer we reach only through a relay is asked after the peers on a direct
    connection (one that pulled the body serves it faster, and spares the relay); a slow
    relayed path is no offence of the announcer."""
    a = await make_node(payload_pull_timeout_s=1.0)  # the announcer, "behind a relay"
    c = await make_node(bootstrap=a.listen_addrs)  # a direct peer that holds the body
    b = await make_node(bootstrap=a.listen_addrs, payload_pull_timeout_s=1.0)
    await wait_until(lambda: {a.peer_id, c.peer_id} <= set(b.connected_peers()), 30,
                     what="b connected to a and c")
    monkeypatch.setattr(b, "is_relayed", lambda peer: peer == a.peer_id)
    body, ann, _ = announce_of(a, batch(a.peer_id, 8192, 1))
    c.gossip.store_payload(ann.content_hash, body)
    asked: list[bytes] = []
    a.gossip.body_server.lookup = lambda digest: asked.append(digest)  # holds nothing
    assert await b.gossip.fetch_payload(ann, a.peer_id) == body
    assert asked == [] and b.metrics["rejected"] == 0  # c served it; a was not asked

    async def stall(peer, conn):  # a relayed path that never delivers
        await asyncio.Event().wait()

    a.bulk.register(BODY, stall)
    await drop_warm_connection(b, a)
    assert await b.gossip.fetch_payload(ann, a.peer_id, sources=[a.peer_id]) is None
    assert b.metrics["rejected"] == 0 and b.penalties.score(a.peer_id) == 0


async def test_oversized_and_slow_answers_are_bounded(make_node):
    a = await make_node()
    b = await make_node(bootstrap=a.listen_addrs, payload_pull_timeout_s=1.0)
    await wait_until(lambda: a.peer_id in b.connected_peers(), 30, what="the connection")
    await drop_warm_connection(b, a)  # each pull below on a connection of its own
    body, ann, _ = announce_of(a, batch(a.peer_id, 8192, 1))
    a.gossip.body_server.lookup = lambda digest: body + b"x" * 1000  # longer than announced
    assert await b.gossip.fetch_payload(ann, a.peer_id, sources=[a.peer_id]) is None
    assert b.metrics["rejected.too_large"] == 1
    assert b.metrics["payload_pulled_bulk"] == 0

    async def stall(peer, conn):  # authenticated, then never answers
        await asyncio.Event().wait()

    a.bulk.register(BODY, stall)
    assert await b.gossip.fetch_payload(ann, a.peer_id, sources=[a.peer_id]) is None
    assert b.metrics["rejected.unserved_announce"] == 1  # the timeout, counted
    assert b.penalties.score(a.peer_id) > 0


async def test_pull_survives_a_pooled_connection_the_server_closed(make_node):
    a = await make_node()
    b = await make_node(bootstrap=a.listen_addrs)
    await wait_until(lambda: a.peer_id in b.connected_peers(), 30, what="the connection")
    for round_ in (1, 2):
        body, ann, _ = announce_of(a, batch(a.peer_id, 8192, round_))
        a.gossip.store_payload(ann.content_hash, body)
        assert await b.gossip.fetch_payload(ann, a.peer_id, sources=[a.peer_id]) == body
        for rec in list(a.bulk.server.conns):  # as its idle timeout would
            rec.task.cancel()
    assert b.metrics["payload_pulled_bulk"] == 2  # the second on a fresh connection
    assert b.metrics["rejected"] == 0 and b.penalties.score(a.peer_id) == 0


async def test_bodies_changed_on_the_path_cost_the_source_nothing(make_node):
    """An on-path attacker flips a bit of the body: TLS refuses the record, the pull goes
    over libp2p for that source, and the honest source is not charged."""
    from swarm_node.node.testing.onpath import Proxy

    a = await make_node()
    b = await make_node(bootstrap=a.listen_addrs)
    await wait_until(lambda: a.peer_id in b.connected_peers(), 30, what="the connection")
    await drop_warm_connection(b, a)
    proxy = Proxy(a.bulk.bound[1], flip_after=4000)  # inside the answer of the first pull
    b.bulk.client.set_endpoint(a.peer_id, f"127.0.0.1:{await proxy.start()}")
    body, ann, _ = announce_of(a, batch(a.peer_id, 8192, 1))
    a.gossip.store_payload(ann.content_hash, body)
    try:
        assert await b.gossip.fetch_payload(ann, a.peer_id, sources=[a.peer_id]) == body
    finally:
        proxy.close()
    assert proxy.flipped == 1
    assert b.metrics["payload_pulled_libp2p"] == 1 and b.metrics["payload_pulled_bulk"] == 0
    assert b.metrics["rejected"] == 0 and b.penalties.score(a.peer_id) == 0
    assert not b.gossip.puller.usable(a.peer_id)  # libp2p for this source for a while


def test_bulk_listen_address_settings():
    from swarm_node.node.p2p.bulk import listen_address

    assert listen_address("auto", ["/ip4/0.0.0.0/tcp/4001"]) == ("0.0.0.0", 4002)
    assert listen_address("auto", ["/ip6/::/tcp/4001"]) == ("::", 4002)
    assert listen_address("auto", ["/ip4/127.0.0.1/tcp/0"]) == ("127.0.0.1", 0)
    assert listen_address("off", ["/ip4/0.0.0.0/tcp/4001"]) is None
    assert listen_address("10.0.0.2:9000", []) == ("10.0.0.2", 9000)
    assert listen_address("[::1]:9000", []) == ("::1", 9000)
    for bad in ("9000", "host:", "host:port", "host:70000"):
        with pytest.raises(ValueError, match="bulk.listen"):
            listen_address(bad, [])


async def test_a_node_behind_nat_offers_no_plane_but_dials_out(make_node):
    """A node that is not publicly reachable (P2PNode.reachability: the hook says no)
    advertises no endpoint and answers the endpoint query with none, so its peers pull from
    it over libp2p streams; it still pulls from public peers over their bulk planes."""
    public = await make_node()
    natted = await make_node(bootstrap=public.listen_addrs)
    natted.bulk.reachable = lambda: False
    await wait_until(lambda: public.peer_id in natted.connected_peers(), 30,
                     what="the connection")
    assert natted.bulk.endpoint == "" and natted.bulk.server is not None
    for source, puller in ((natted, public), (public, natted)):
        await drop_warm_connection(puller, source)
        puller.bulk.client._resolved.clear()  # forget what the warm-ups learnt
        body, ann, _ = announce_of(source, batch(source.peer_id, 8192, 1))
        source.gossip.store_payload(ann.content_hash, body)
        assert await puller.gossip.fetch_payload(ann, source.peer_id,
                                                 sources=[source.peer_id]) == body
    assert public.metrics["payload_pulled_libp2p"] == 1  # from the NAT'd node
    assert natted.metrics["payload_pulled_bulk"] == 1  # out to the public one
    assert public.metrics["rejected"] == natted.metrics["rejected"] == 0


async def _hedge_setup(make_node, n_holders: int, **p2p):
    """b pulls from a, whose plane takes the request and never answers (a NAT'd origin on a
    stalled uplink), and from `n_holders` other peers; returns (a, b, holders, the event
    set when a's stalled connection is closed by b)."""
    a = await make_node()
    holders = [await make_node(bootstrap=a.listen_addrs) for _ in range(n_holders)]
    p2p = {"payload_pull_hedge_s": 0.3, "payload_pull_timeout_s": 20.0, **p2p}
    b = await make_node(bootstrap=a.listen_addrs, **p2p)
    want = {a.peer_id, *(h.peer_id for h in holders)}
    await wait_until(lambda: want <= set(b.connected_peers()), 30, what="b connected to all")
    let_go = asyncio.Event()

    async def stall(peer, conn):  # reads the request, answers nothing, notices the close
        await conn.readexactly(32)
        try:
            await conn.readexactly(1)
        except Exception:  # noqa: BLE001 - closed by b: EOF or a broken connection
            let_go.set()

    a.bulk.register(BODY, stall)
    await drop_warm_connection(b, a)
    return a, b, holders, let_go


async def test_a_stalled_pull_is_hedged_to_another_holder(make_node):
    """The first source does not answer within p2p.payload_pull_hedge_s: the other holder is
    asked meanwhile, its verified body wins, the stalled ask is cancelled (its connection
    closed) and not charged; one extra ask, counted."""
    from swarm_node.node.p2p.pubsub import BodyTrace

    a, b, (c,), let_go = await _hedge_setup(make_node, 1)
    body, ann, _ = announce_of(a, batch(a.peer_id, 8192, 1))
    c.gossip.store_payload(ann.content_hash, body)
    trace = BodyTrace(a.peer_id, 0.0)
    assert await b.gossip.fetch_payload(ann, a.peer_id, sources=[a.peer_id, c.peer_id],
                                        trace=trace) == body
    assert trace.hedged and trace.hedge_won and trace.source == c.peer_id
    assert trace.asks == 2
    assert b.metrics["payload_pull_hedges"] == 1 and b.metrics["payload_pull_hedge_won"] == 1
    await wait_until(let_go.is_set, 10, what="the stalled ask let go")
    # cancelled, not timed out: no miss, no reject, no penalty for the slow holder
    assert b.metrics["payload_pull_misses"] == 0 and b.metrics["rejected"] == 0
    assert b.penalties.score(a.peer_id) == 0 and c.metrics["payload_bulk_served"] == 1


async def test_junk_from_a_hedge_is_rejected_and_charged(make_node):
    """The hedge's first source serves other bytes than announced: rejected (hash_mismatch),
    charged to it; the next holder's verified body wins; the stalled origin is not charged."""
    from swarm_node.node.p2p.pubsub import BodyTrace

    a, b, (c, d), _ = await _hedge_setup(make_node, 2)
    body, ann, _ = announce_of(a, batch(a.peer_id, 8192, 1))
    forged = bytearray(body)
    forged[-1] ^= 1
    c.gossip.store_payload(ann.content_hash, bytes(forged))
    d.gossip.store_payload(ann.content_hash, body)
    trace = BodyTrace(a.peer_id, 0.0)
    assert await b.gossip.fetch_payload(ann, a.peer_id,
                                        sources=[a.peer_id, c.peer_id, d.peer_id],
                                        trace=trace) == body
    assert trace.hedge_won and trace.source == d.peer_id
    assert b.metrics["rejected.hash_mismatch"] == 1 and b.penalties.score(c.peer_id) > 0
    assert b.metrics["payload_pull_hedges"] == 1
    assert b.penalties.score(a.peer_id) == 0 and b.penalties.score(d.peer_id) == 0


async def test_no_hedge_when_off_or_nobody_else_holds_it(make_node):
    """p2p.payload_pull_hedge_s = 0: the stalled ask is waited out (its timeout, charged as
    before), then the other holder is asked. With one source only, nothing to hedge to."""
    a, b, (c,), _ = await _hedge_setup(make_node, 1, payload_pull_hedge_s=0.0,
                                       payload_pull_timeout_s=1.0)
    body, ann, _ = announce_of(a, batch(a.peer_id, 8192, 1))
    c.gossip.store_payload(ann.content_hash, body)
    assert await b.gossip.fetch_payload(ann, a.peer_id, sources=[a.peer_id, c.peer_id]) == body
    assert b.metrics["payload_pull_hedges"] == 0
    assert b.metrics["rejected.unserved_announce"] == 1  # a direct announcer that timed out
    hedging = await make_node(bootstrap=c.listen_addrs, payload_pull_hedge_s=0.2)
    await wait_until(lambda: c.peer_id in hedging.connected_peers(), 30, what="the connection")
    assert await hedging.gossip.fetch_payload(ann, a.peer_id, sources=[c.peer_id]) == body
    assert hedging.metrics["payload_pull_hedges"] == 0
    # the deadline follows this node's answered asks when they are slow (all pulls slow:
    # a fixed 0.2 s would hedge nearly every one)
    # one ask so far: the floor, or HEDGE_FACTOR x that ask where it was slow (a loaded
    # machine: the first ask also sets up the bulk connection)
    (asked,) = hedging.gossip._ask_s
    assert hedging.gossip.hedge_after_s() == max(0.2, HEDGE_FACTOR * asked)
    hedging.gossip._ask_s.extend([0.1] * 10 + [3.0] * 20)
    assert hedging.gossip.hedge_after_s() == 6.0


async def test_a_stalled_pull_over_libp2p_is_hedged_and_its_stream_reset(make_node):
    """The slow source has no bulk plane (a NAT'd origin: libp2p streams): the hedge wins
    the same way, and the cancelled request's stream is reset, not left half-open in the
    muxer (one per stalled pull would pile up)."""
    from libp2p.peer.id import ID
    from swarm_node.protocol.ids import FETCH_PROTOCOL

    a = await make_node(bulk_listen="off")
    c = await make_node(bootstrap=a.listen_addrs)
    b = await make_node(bootstrap=a.listen_addrs, payload_pull_hedge_s=0.3)
    await wait_until(lambda: {a.peer_id, c.peer_id} <= set(b.connected_peers()), 30,
                     what="b connected to a and c")
    asked = asyncio.Event()

    async def stall(peer, request):
        asked.set()
        await asyncio.Event().wait()

    await a.requests.set_request_handler(FETCH_PROTOCOL, stall)
    body, ann, _ = announce_of(a, batch(a.peer_id, 8192, 1))
    c.gossip.store_payload(ann.content_hash, body)

    def fetches_to_a() -> int:  # b's FETCH streams to a still open
        conns = b.gossip.ctx.host.get_network().connections.get(ID.from_base58(a.peer_id), [])
        return sum(str(stream.get_protocol()) == FETCH_PROTOCOL
                   for conn in conns for stream in list(conn.streams))

    assert await b.gossip.fetch_payload(ann, a.peer_id, sources=[a.peer_id, c.peer_id]) == body
    assert asked.is_set() and b.metrics["payload_pull_hedge_won"] == 1
    await wait_until(lambda: fetches_to_a() == 0, 10, what="the cancelled stream reset")
    assert b.metrics["rejected"] == 0 and b.penalties.score(a.peer_id) == 0


async def test_a_body_on_its_way_is_served_when_it_lands_not_refused(make_node):
    # a forwarded the announce before the body reached it (it is fetching it): b's pull is
    # answered when the body lands there, not "not held" and asked again after a back-off.
    from swarm_node.node.p2p.bodies import PullFailed

    a, b, _ = await pair(make_node)
    body, ann, _ = announce_of(a, batch(a.peer_id, 8192, 1))
    with pytest.raises(PullFailed) as refused:  # nothing on its way: refused at once
        await b.gossip.puller.pull(a.peer_id, ann.content_hash, ann.size)
    assert refused.value.reason == "not_held"
    a.gossip._coming[ann.content_hash] = asyncio.Event()  # as _pull_announced registers it
    pull = asyncio.create_task(b.gossip.puller.pull(a.peer_id, ann.content_hash, ann.size))
    await wait_until(lambda: a.metrics["payload_bulk_holds"] == 1, 10,
                     what="the pull to wait at a")
    a.gossip.store_payload(ann.content_hash, body)
    assert await asyncio.wait_for(pull, 10) == body
    assert a.metrics["payload_bulk_served_on_arrival"] == 1
    assert a.metrics["payload_bulk_not_held"] == 1


async def test_the_forwarder_is_asked_before_an_announcer_without_a_plane(make_node):
    # a (its plane unusable: as behind NAT) would serve over libp2p streams through its home
    # uplink; c, which brought us a's messages and whose plane we can use, is asked first.
    a = await make_node(bulk_listen="off")
    c = await make_node(bootstrap=a.listen_addrs)
    b = await make_node(bootstrap=a.listen_addrs)
    await wait_until(lambda: {a.peer_id, c.peer_id} <= set(b.connected_peers()), 30,
                     what="b connected to a and c")
    b.bulk.client.mark_down(a.peer_id, BODY, "no plane (test)")  # as a failed pull does
    b.gossip.validator.carried_by[a.peer_id] = c.peer_id
    assert b.gossip.pull_sources(a.peer_id)[:2] == [c.peer_id, a.peer_id]
    body, ann, _ = announce_of(a, batch(a.peer_id, 8192, 1))
    a.gossip.store_payload(ann.content_hash, body)
    c.gossip.store_payload(ann.content_hash, body)
    assert await b.gossip.fetch_payload(ann, a.peer_id) == body
    assert b.metrics["payload_pulled_bulk"] == 1 and b.metrics["payload_pulled_libp2p"] == 0
