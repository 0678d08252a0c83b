"""Pubsub peering of a pair that holds two connections (both dialled at once, or a redial)
when one of them closes: gossip keeps flowing both ways on the other.

Regression test of a fresh-clone CI flake (a pair of hosts that never saw each other's
subscription): py-libp2p 0.8.1 forgot a peer's subscriptions whenever its own pubsub stream
to that peer failed, and the peer, whose stream to us lived on, never re-sent them.
"""

from __future__ import annotations

import multiaddr
from libp2p.peer.id import ID

from .conftest import verdict, wait_until

KIND = "verdicts"


async def _t_dial_again(node, other) -> None:
    """A second connection from `node` to `other` (P2PNode.connect reuses the first)."""
    network = node.context.host.get_network()
    await network.dial_addr(multiaddr.Multiaddr(other.listen_addrs[0]),
                            ID.from_base58(other.peer_id))


async def _t_close_pubsub_connection(node, other) -> None:
    """Close the connection that carries `node`'s pubsub stream to `other`."""
    peer = ID.from_base58(other.peer_id)
    carrying = node.context.pubsub.peers[peer].muxed_conn
    for conn in list(node.context.host.get_network().connections.get(peer, [])):
        if conn.muxed_conn is carrying:
            await conn.close()
            return
    raise AssertionError("no connection carries the pubsub stream")


def _connections(node, other) -> int:
    conns = node.context.host.get_network().connections.get(ID.from_base58(other.peer_id), [])
    return sum(1 for c in conns if not c.muxed_conn.is_closed)


async def test_gossip_survives_closing_one_of_two_connections(make_node):
    a = await make_node(discovery=False)
    b = await make_node(discovery=False)
    got: dict[str, list[int]] = {a.peer_id: [], b.peer_id: []}

    def collector(me):
        async def on_msg(env, peer):
            got[me].append(env.message.policy_version)
        return on_msg

    for x in (a, b):
        await x.subscribe(KIND, collector(x.peer_id))
    await a.connect(b.listen_addrs[0])
    await wait_until(lambda: a.gossip.topic_peers(KIND) == [b.peer_id]
                     and b.gossip.topic_peers(KIND) == [a.peer_id], 15, what="both subscriptions")

    # Both pubsub streams run on the first connection; a second one joins the pair, then
    # the first closes: each side's next write fails and it re-opens its stream.
    await b.context.bridge.call(_t_dial_again, b, a)
    await wait_until(lambda: _connections(a, b) == 2 and _connections(b, a) == 2, 15,
                     what="a second connection")
    await a.context.bridge.call(_t_close_pubsub_connection, a, b)
    await wait_until(lambda: _connections(a, b) == 1 and _connections(b, a) == 1, 15,
                     what="the first connection closed")

    await a.publish(KIND, verdict(1))
    await wait_until(lambda: 1 in got[b.peer_id], 15, what="a's message at b")
    await b.publish(KIND, verdict(2))
    await wait_until(lambda: 2 in got[a.peer_id], 15, what="b's message at a")
    for x, other in ((a, b), (b, a)):
        assert x.gossip.topic_peers(KIND) == [other.peer_id]
        await x.publish(KIND, verdict(3))
    await wait_until(lambda: 3 in got[a.peer_id] and 3 in got[b.peer_id], 15,
                     what="a second message each way")
    assert got == {a.peer_id: [2, 3], b.peer_id: [1, 3]}  # each once: none lost, none twice


async def test_subscribe_while_a_new_peer_is_set_up_reaches_that_peer(make_node):
    # py-libp2p registers a new pubsub peer in steps: open the stream, write the hello (our
    # topics as they are then), add the peer to Pubsub.peers. A subscribe in between was
    # announced to the registered peers only, so the new peer never learned of it and kept
    # its messages for us pending for good (the fresh-clone flake of
    # test_restart_with_same_key_rejoins). Here the subscribe is started right after the
    # hello is built, while its write is in flight.
    a = await make_node(discovery=False)
    b = await make_node(discovery=False)
    topic = a.topic(KIND)
    hello = a.context.pubsub.get_hello_packet
    started = []

    def hello_then_subscribe():
        packet = hello()
        if not started:
            started.append(packet)
            a.context.nursery.start_soon(a.context.pubsub.subscribe, topic)
        return packet

    a.context.pubsub.get_hello_packet = hello_then_subscribe
    got = []

    async def on_msg(env, peer):
        got.append(env.message.policy_version)

    await b.subscribe(KIND, on_msg)
    await a.connect(b.listen_addrs[0])
    await wait_until(lambda: started and ID.from_base58(b.peer_id) in a.context.pubsub.peers, 15,
                     what="a's pubsub stream to b")
    assert not any(s.subscribe for s in started[0].subscriptions)  # the hello lacked it
    await a.subscribe(KIND, on_msg)  # the handler; py-libp2p is subscribed already
    await wait_until(lambda: b.gossip.topic_peers(KIND) == [a.peer_id], 15,
                     what="b learns that a subscribed")
    await b.publish(KIND, verdict(7))
    await wait_until(lambda: got == [7], 15, what="b's message at a")
