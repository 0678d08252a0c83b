"""Links adverts (node/p2p/gossip_push.py): a pusher tells the peers it pushes to whom it
pushes to, so a publisher behind NAT names each of its other subscribers to one public peer
known to reach it, and public peers given a body in a forward-all frame push it on to an
unnamed subscriber once between them, not FORWARD_COPIES times. Real libp2p hosts and bulk
planes on loopback; nodes with no plane of their own stand for peers behind NAT."""

from __future__ import annotations

import asyncio

import pytest
from swarm_node.node.p2p import gossip_push

from .conftest import wait_until
from .test_payload_plane import KIND as TOPIC
from .test_payload_plane import batch


def reached(node, forwarder, peer) -> bool:
    """`node` holds `forwarder`'s links advert, and it names `peer`."""
    return peer.peer_id in node.gossip.pusher.reach.get(forwarder.peer_id, ())


@pytest.mark.parametrize("named", [True, False], ids=["named", "forward-all"])
async def test_a_nat_publishers_body_reaches_a_subscriber_once(make_node, monkeypatch, named):
    # b behind NAT pushes to its two public peers c and d (p2p.payload_push_via 2); a,
    # behind NAT too, holds links from both. named: b is connected to a and names it in its
    # forward frames; forward-all: b is not, and c and d push the body on to their own
    # subscriber a. Before the adverts a was given to both (FORWARD_COPIES), so both pushed
    # each body to it: a duplicate 64 KiB copy over a public uplink per body and
    # subscriber (~52 a round in the 12-node simulated WAN). a waits 20 s for a push before
    # it pulls (0.3 s in the node): the claim is who pushes, not how fast.
    monkeypatch.setattr(gossip_push, "PUSH_WAIT_S", 20.0)
    c = await make_node()
    d = await make_node(bootstrap=c.listen_addrs, discovery=False)
    b = await make_node(bootstrap=c.listen_addrs[:1] + d.listen_addrs[:1],
                        bulk_listen="off", discovery=False, payload_push_via=2)
    a = await make_node(bootstrap=c.listen_addrs[:1] + d.listen_addrs[:1]
                        + (b.listen_addrs[:1] if named else []),
                        bulk_listen="off", discovery=False)
    got = []

    async def on_msg(env, peer):
        got.append(env)

    for n in (a, b, c, d):
        await n.subscribe(TOPIC, on_msg if n is a else (lambda env, peer: asyncio.sleep(0)))
    public = (c, d)

    def ready() -> bool:
        return (all(p.peer_id in b.gossip.pusher.out and a.peer_id in p.gossip.pusher.out
                    and a.peer_id in p.gossip.topic_peers(TOPIC)
                    and b.peer_id in p.gossip.topic_peers(TOPIC)
                    and a.gossip.pusher.pushes_to_us(p.peer_id) for p in public)
                # the adverts: b's (named) or each other's (forward-all) say who reaches a
                and (a.peer_id in b.gossip.topic_peers(TOPIC)
                     and all(reached(b, p, a) for p in public) if named
                     else reached(c, d, a) and reached(d, c, a)))

    await wait_until(ready, 30, what="the links and their adverts")
    assert not b.gossip._public()
    assert (b.peer_id in a.connected_peers()) is named
    for r in range(1, 5):
        await wait_until(ready, 30, what="the links")
        await b.publish(TOPIC, batch(b.peer_id, 8192, r))
        await wait_until(lambda r=r: len(got) == r, 30, what=f"batch {r}")
        # both forwarders checked the body (each forwards, or not, before it counts it)
        await wait_until(lambda r=r: all(p.metrics["payload_fetched"] >= r for p in public),
                         30, what=f"the forwarders' batch {r}")
        assert sum(p.metrics["payload_push_forwarded"] for p in public) == r
    assert b.metrics["payload_pushed"] == 8  # to c and d, never to a
    assert a.metrics["payload_push_claimed"] == 4
    assert a.metrics["payload_push_duplicate"] == 0
    assert a.metrics["payload_pulled_bulk"] + a.metrics["payload_pulled_libp2p"] == 0
