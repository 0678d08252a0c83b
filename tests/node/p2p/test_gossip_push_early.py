"""A forwarder pushes a body on before its announce when the body proves its origin
(node/p2p/gossip_push.py `_forward_early`): the origin pushed its own signed envelope.
Real libp2p hosts and bulk planes on loopback; the origin writes its frame on a push link
of its own and announces only when the test says, so nothing here races a clock."""

from __future__ import annotations

import asyncio
import hashlib

from swarm_node.node.p2p import pubsub
from swarm_node.node.p2p.gossip_push import _FRAME, FRAME_FORWARD, _names
from swarm_node.protocol.limits import TopicRate

from .conftest import wait_until
from .test_gossip_push import raw_link
from .test_payload_plane import KIND as TOPIC
from .test_payload_plane import announce_of, batch


def forward_frame(body: bytes, names: list[str]) -> bytes:
    return _FRAME.pack(FRAME_FORWARD, hashlib.sha256(body).digest(), len(body)) + \
        _names(names) + body


async def three(make_node):
    """c public; a and b as behind NAT (no plane), each with links to and from c; all
    subscribed to TOPIC. (a, b, c, what a got)."""
    c = await make_node()
    a = await make_node(bootstrap=c.listen_addrs, bulk_listen="off", discovery=False)
    b = await make_node(bootstrap=c.listen_addrs, bulk_listen="off", discovery=False)
    got = []

    async def on_msg(env, peer):
        got.append(env)

    for n in (a, b, c):
        await n.subscribe(TOPIC, on_msg if n is a else (lambda env, peer: asyncio.sleep(0)))
    await wait_until(lambda: a.peer_id in c.gossip.pusher.out
                     and a.gossip.pusher.pushes_to_us(c.peer_id)
                     and b.peer_id in c.gossip.topic_peers(TOPIC), 30, what="the links")
    return a, b, c, got


def held_from(node, digest: bytes, pusher) -> bool:
    entry = node.gossip.pusher.unclaimed.get(digest)
    return entry is not None and entry.pusher == pusher.peer_id


async def test_a_forwarder_pushes_an_origins_own_body_on_before_its_announce(make_node):
    # In the 12-node WAN lab a public peer pushed a NAT'd origin's body on only once the
    # announce had reached it through the mesh and been checked: forwards landed 0.45-0.50
    # / 0.75-0.86 s into the round (p50 / p95) and ended the rounds (RESULTS "wan:
    # gossip"). The body is the origin's signed envelope, pushed by the origin itself: c
    # forwards it to a at once; the announce, later, delivers it at a without a pull and
    # c does not forward it again.
    a, b, c, got = await three(make_node)
    body, ann, sealed_ann = announce_of(b, batch(b.peer_id, 8192, 1))
    conn = await raw_link(b, c)
    try:
        await conn.write(forward_frame(body, [a.peer_id]))
        await wait_until(lambda: held_from(a, ann.content_hash, c), 30,
                         what="c's forward before any announce")
        assert c.metrics["payload_push_forwarded_early"] == 1
        assert c.metrics["payload_push_claimed"] == 0  # no announce yet
        b.gossip.store_payload(ann.content_hash, body)
        await b.gossip.publish_raw(TOPIC, sealed_ann)
        await wait_until(lambda: len(got) == 1 and c.metrics["payload_push_claimed"] == 1,
                         30, what="the batch at a, the announce at c")
        assert got[0].message.round == 1
        assert a.metrics["payload_push_claimed"] == 1
        assert a.metrics["payload_pulled_bulk"] + a.metrics["payload_pulled_libp2p"] == 0
        assert c.metrics["payload_push_forwarded"] == 1  # once, early
    finally:
        conn.abort()


async def test_a_body_pushed_by_another_than_its_signer_waits_for_the_announce(make_node):
    # A pusher that is not the body's signer proves nothing: c holds b's body that d
    # pushed, naming a, until b's announce is checked, as before; then forwards it.
    a, b, c, got = await three(make_node)
    d = await make_node(bootstrap=c.listen_addrs, discovery=False)
    await d.subscribe(TOPIC, lambda env, peer: asyncio.sleep(0))
    await wait_until(lambda: d.peer_id in c.gossip.pusher.out, 30, what="c's link to d")
    body, ann, sealed_ann = announce_of(b, batch(b.peer_id, 8192, 1))
    conn = await raw_link(d, c)  # d carries b's body, naming a
    try:
        await conn.write(forward_frame(body, [a.peer_id]))
        await wait_until(lambda: held_from(c, ann.content_hash, d), 30, what="the push")
        assert c.metrics["payload_push_forwarded_early"] == 0
        assert not a.gossip.pusher.unclaimed and not got
        b.gossip.store_payload(ann.content_hash, body)
        await b.gossip.publish_raw(TOPIC, sealed_ann)
        await wait_until(lambda: len(got) == 1, 30, what="the batch at a")
        assert c.metrics["payload_push_forwarded"] == 1
        assert c.metrics["payload_push_forwarded_early"] == 0
    finally:
        conn.abort()


async def test_an_origins_bad_body_is_not_forwarded_early(make_node):
    # A body that does not open (here: not an envelope at all, pushed by b itself) is
    # held for an announce that never comes; c forwards nothing.
    a, b, c, _ = await three(make_node)
    junk = b"\x93" + bytes(8000)
    conn = await raw_link(b, c)
    try:
        await conn.write(forward_frame(junk, [a.peer_id]))
        digest = hashlib.sha256(junk).digest()
        await wait_until(lambda: held_from(c, digest, b), 30, what="the push")
        assert c.metrics["payload_push_forwarded_early"] == 0
        assert c.metrics["payload_push_forwarded"] == 0
        assert not a.gossip.pusher.unclaimed
    finally:
        conn.abort()


async def test_early_forwards_are_bounded_by_the_origins_rate(make_node, monkeypatch):
    # Bodies an origin pushes and never announces pass no announce's admission: its early
    # forwards take tokens of their own, at the topic's per-origin rate (here a burst of
    # 1, refilled once in 1000 s): the second body waits for its announce.
    a, b, c, _ = await three(make_node)
    admission = c.gossip.validator.admission
    rates = admission.rates if admission is not None else pubsub.DEFAULT_TOPIC_RATES
    monkeypatch.setitem(rates, TOPIC, TopicRate(per_s=0.001, burst=1.0))
    bodies = [announce_of(b, batch(b.peer_id, 8192, r))[:2] for r in (1, 2)]
    conn = await raw_link(b, c)
    try:
        for body, _ in bodies:
            await conn.write(forward_frame(body, [a.peer_id]))
        await wait_until(lambda: all(held_from(c, ann.content_hash, b)
                                     or held_from(a, ann.content_hash, c)
                                     for _, ann in bodies), 30, what="both pushes")
        await wait_until(lambda: held_from(a, bodies[0][1].content_hash, c), 30,
                         what="the first body's early forward")
        assert c.metrics["payload_push_early_rate_limited"] == 1
        assert c.metrics["payload_push_forwarded_early"] == 1
        assert held_from(c, bodies[1][1].content_hash, b)  # waits for its announce
        assert not held_from(a, bodies[1][1].content_hash, c)
    finally:
        conn.abort()
