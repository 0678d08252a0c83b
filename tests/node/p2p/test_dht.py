"""Kad-DHT across a chain of real hosts (each knows only its neighbour): swarm peers and
the providers of a key are found hops away."""

from __future__ import annotations

from swarm_node.node.p2p.dht import dht_key

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
