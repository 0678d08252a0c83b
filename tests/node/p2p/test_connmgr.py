"""The connection bound: whatever the swarm's size, a node keeps at most p2p.max_peers
connections (trimming the least useful down to target_peers), never its protected peers,
and the bounded graph still carries gossip to everyone."""

from __future__ import annotations

import asyncio
import contextlib

from .conftest import verdict, wait_until

N = 12
BOUND = {"target_peers": 3, "max_peers": 5, "connection_grace_s": 3.0}


async def test_connection_bound_holds_with_many_peers(make_node):
    boot = await make_node(**BOUND)
    nodes = [boot] + [await make_node(bootstrap=boot.listen_addrs, **BOUND)
                      for _ in range(N - 1)]
    keep = nodes[-1].peer_id
    boot.protect(keep, "test")  # protection is one-sided (each side trims its own)
    nodes[-1].protect(boot.peer_id, "test")
    got = {n.peer_id: [] for n in nodes}
    everyone = asyncio.Event()  # set once every node but the publisher (nodes[3]) has one
    for n in nodes:
        async def on_verdict(env, origin, me=n.peer_id):
            got[me].append(env.message.policy_version)
            if all(v for p, v in got.items() if p != nodes[3].peer_id):
                everyone.set()
        await n.subscribe("verdicts", on_verdict)
    # Everyone joined through `boot`, which had N - 1 connections: it trimmed to target.
    await wait_until(lambda: boot.connmgr.trimmed > 0, 30, what="the bootstrap node trims")
    await wait_until(lambda: all(len(n.connected_peers()) <= BOUND["max_peers"] for n in nodes),
                     30, what="every node within the bound")
    assert keep in boot.connected_peers()  # protected
    # a node whose only connection the bootstrap node trimmed is alone until its discovery
    # dials again (it is below target): none stays alone (a snapshot here failed once in CI,
    # 2026-12-05, beside a heavy test: a node between the trim and its next dial)
    await wait_until(lambda: all(n.connected_peers() for n in nodes), 30,
                     what="no node left without a connection")
    # The bounded graph carries gossip to every node (mesh forwarding and IHAVE gossip, not
    # one hop). GossipSub is best effort while meshes re-form after the trims (a peer
    # pruned with a backoff may miss one message), so the publisher sends one message a
    # second until each node holds at least one of them. A mesh island (a triangle at
    # D_low) linked to the rest only by links that carried a PRUNE gets them by IHAVE
    # gossip over those links (patches/mesh_backoff.py: py-libp2p sent none there).
    publisher = nodes[3]
    others = [p for p in got if p != publisher.peer_id]
    sent = 0
    while not all(got[p] for p in others):
        if sent >= 30:
            idx = {n.peer_id: i for i, n in enumerate(nodes)}
            view = {i: (sorted(idx.get(p, -1) for p in n.connected_peers()),
                        sorted(idx.get(p, -1) for p in n.gossip.mesh_peers("verdicts")))
                    for i, n in enumerate(nodes)}
            missing = [idx[p] for p in others if not got[p]]
            raise AssertionError(f"{sent} sent, none reached {missing}; conns/mesh {view}")
        await publisher.publish("verdicts", verdict(sent))
        sent += 1
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(everyone.wait(), 1.0)
    # New connections (peers' redials, DHT lookups) may exceed the bound for the grace
    # period and the trim's debounce; then it holds again.
    await wait_until(lambda: all(len(n.connected_peers()) <= BOUND["max_peers"] for n in nodes),
                     30, what="every node back within the bound")
