"""Kad-DHT across a chain of real hosts (each knows only its neighbour): swarm peers and
the providers of a key are found hops away."""

from __future__ import annotations

import asyncio

from swarm_node.node.identity import Identity
from swarm_node.node.p2p import P2PNode
from swarm_node.node.p2p.dht import dht_key
from swarm_node.node.p2p.reachability import Verdict

from .conftest import p2p_config, wait_until

CHAIN = 6


async def chain(make_node, role="inference"):
    """The first node an inference peer, the others of `role`."""
    nodes = [await make_node(discovery=False)]
    for _ in range(CHAIN - 1):
        nodes.append(await make_node(bootstrap=nodes[-1].listen_addrs, discovery=False,
                                     node={"role": role}))
    return nodes


async def test_dht_finds_providers_across_a_chain(make_node):
    nodes = await chain(make_node)
    first, last = nodes[0], nodes[-1]
    assert last.peer_id not in first.connected_peers()
    key = dht_key("checkpoint", "policy-x/v7")
    assert await last.provide(key)
    found = dict(await first.find_providers(key))
    assert last.peer_id in found and found[last.peer_id][0].endswith(f"/p2p/{last.peer_id}")
    assert await first.find_providers(dht_key("checkpoint", "nobody-has-this")) == []


async def test_dht_finds_public_swarm_peers_and_discovery_uses_them(make_node):
    nodes = await chain(make_node, role="relay")
    for n in nodes:
        assert await n.dialback.check() in (True, None)  # loopback: public
    assert not nodes[0].dht.anchors_swarm()  # an inference peer does not announce itself
    for n in nodes[1:]:
        assert n.dht.anchors_swarm()  # public relays do
        await n.dht.provide_swarm()
    peers = dict(await nodes[0].dht.swarm_peers())
    assert nodes[-1].peer_id in peers and nodes[0].peer_id not in peers
    # Discovery, out of peers to dial, takes them from the DHT (the lookups above may have
    # connected them already: nothing is excluded here).
    d = nodes[0].discovery
    got = await d._from_dht(set())
    assert nodes[-1].peer_id in {pid for pid, _ in got}
    assert nodes[-1].peer_id in d.known


async def test_a_natted_provider_advertises_its_relayed_addresses(make_node):
    """Behind NAT (listening on 127.0.0.2, dialling out from 127.0.0.1: test_relay's NAT in
    miniature) a provider record carries the node's /p2p-circuit addresses only (test_relay
    dials one); without a relay slot the node provides nothing."""
    relay = await make_node(hole_punching=False, **{"relay.service": "on"})

    async def natted(host: int, bootstrap: list[str]) -> P2PNode:  # one peer: no other dials
        cfg = p2p_config(hole_punching=False, target_peers=1).with_overrides(
            {"node.listen": [f"/ip4/127.0.0.{host}/tcp/0"]})
        node = P2PNode(Identity.generate(), cfg)
        await node.start(bootstrap=bootstrap)
        return node

    a = await natted(2, relay.listen_addrs)
    lone = await natted(3, (await make_node()).listen_addrs)  # its only peer relays nothing
    try:
        await wait_until(lambda: a.reachability.verdict is Verdict.RELAYED, 30, what="A relayed")
        await wait_until(lambda: lone.reachability.verdict is Verdict.UNREACHABLE, 30,
                         what="the lone node's verdict")
        key = dht_key("checkpoint", "policy-y/v1")
        assert not await lone.provide(key)
        assert await a.provide(key)
        finder = await make_node(bootstrap=relay.listen_addrs, discovery=False)
        # the records alone (find_providers adds what peer exchange taught)
        found = dict(await finder.dht.ctx.bridge.call(finder.dht._t_find_providers, key, 20))
        me = f"/p2p/{a.peer_id}"
        assert found[a.peer_id] == [x.removesuffix(me) for x in a.reachability.relay_addrs]
        assert f"/p2p/{relay.peer_id}/p2p-circuit" in found[a.peer_id][0]
    finally:
        await asyncio.gather(a.close(), lone.close())
