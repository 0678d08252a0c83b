"""Who closes a connection. A DHT lookup, when it is done (dht._t_close_transient): those its
own queries dialled, never one that something else opened meanwhile (an inbound
connection, a discovery dial, a hole punch). The connection log (relay.ConnectionLog, DEBUG)
names each close of ours."""

from __future__ import annotations

import asyncio
import logging

import pytest
import trio
from libp2p.kad_dht.common import PROTOCOL_ID
from multiaddr import Multiaddr
from swarm_node.node.p2p.dht import dht_key

from .conftest import wait_until


async def stall_dht(node) -> tuple[list, object]:
    """Make `node` answer DHT queries only once released: (queries held, release)."""
    held: list = []
    gate: dict = {}

    async def install() -> None:
        gate["open"] = trio.Event()

        async def handler(stream) -> None:
            held.append(stream)
            await gate["open"].wait()
            await stream.reset()

        node.dht.ctx.host.set_stream_handler(PROTOCOL_ID, handler)

    async def release() -> None:
        gate["open"].set()

    await node.dht.ctx.bridge.call(install)
    return held, lambda: node.dht.ctx.bridge.call(release)


async def connected(node) -> set[str]:
    """The peers the libp2p side of `node` holds connections to, now."""

    async def read() -> set[str]:
        return {p.to_base58() for p in node.dht._t_connected()}

    return await node.dht.ctx.bridge.call(read)


async def test_a_connection_opened_during_a_lookup_by_someone_else_survives_it(make_node):
    """A (target_peers 1, its one peer P) looks up a key; P holds the query while B dials
    A. When the lookup ends A holds target_peers without B, yet B's connection is not the
    lookup's: it stays (before the fix, every peer connected during a lookup was closed:
    a hole-punched connection among them)."""
    p = await make_node(discovery=False)
    a = await make_node(bootstrap=p.listen_addrs, discovery=False, target_peers=1)
    ap = a.dht.dht.routing_table
    await wait_until(lambda: ap.peer_in_table(p.dht.ctx.host.get_id()), 20,
                     what="P in A's routing table")
    held, release = await stall_dht(p)
    lookup = asyncio.create_task(a.find_providers(dht_key("checkpoint", "nobody/v1")))
    await wait_until(lambda: held, 20, what="A's query held by P")
    b = await make_node(discovery=False)
    await b.connect(a.listen_addrs[0])
    await wait_until(lambda: b.peer_id in a.connected_peers(), 20, what="B connected to A")
    await release()
    await asyncio.wait_for(lookup, 60)
    assert a.metrics["dht_connections_closed"] == 0
    assert b.peer_id in await connected(a)


@pytest.mark.parametrize("lookup", ["find", "provide"])
async def test_a_lookup_closes_the_connections_its_own_queries_opened(make_node, caplog,
                                                                      lookup):
    """A (target_peers 1) knows only P; P knows Q. A's lookup (a find, a provide) walks to
    Q (a dial of its own): once it is done, A, at target_peers without Q, closes that
    connection again, and the connection logs say who closed it (A: the lookup; Q: not its
    own code)."""
    caplog.set_level(logging.DEBUG, logger="swarm_node.node.p2p")
    q = await make_node(discovery=False)
    p = await make_node(bootstrap=q.listen_addrs, discovery=False)
    a = await make_node(bootstrap=p.listen_addrs, discovery=False, target_peers=1)
    pid_q = q.dht.ctx.host.get_id()
    await wait_until(lambda: p.dht.dht.routing_table.peer_in_table(pid_q), 20,
                     what="Q in P's routing table")
    await wait_until(lambda: a.dht.dht.routing_table.peer_in_table(p.dht.ctx.host.get_id()),
                     20, what="P in A's routing table")
    assert q.peer_id not in a.connected_peers()
    if lookup == "find":
        await a.find_providers(dht_key("checkpoint", "nobody/v2"))
    else:
        await a.provide(dht_key("checkpoint", "a/v2"))
    assert a.metrics["dht_connections_closed"] >= 1
    held = await connected(a)
    assert q.peer_id not in held and p.peer_id in held
    await wait_until(lambda: a.peer_id not in q.connected_peers(), 20, what="Q's side closed")

    def logged(peer: str, why: str) -> bool:  # a notifee logs the close after it is gone
        return any(f"connection to {peer} closed" in ln and why in ln for ln in
                   (r.getMessage() for r in caplog.records if r.name.endswith("p2p.relay")))

    await wait_until(lambda: logged(q.peer_id, "closed by us (DHT lookup's own)"), 20,
                     what="A's log: closed by its lookup")
    await wait_until(lambda: logged(a.peer_id, "not closed by our code"), 20,
                     what="Q's log: not closed by its code")


async def test_a_peer_the_lookup_dialled_keeps_a_second_connection_made_meanwhile(make_node):
    """A's lookup dials Q (through P, as above) and Q holds the query; meanwhile Q opens a
    second connection to A, a fresh dial as DCUtR's hole punch makes. That connection is
    not the lookup's: Q stays connected once the lookup is done (before the fix, every peer
    connected since the lookup began was closed)."""
    q = await make_node(discovery=False)
    p = await make_node(bootstrap=q.listen_addrs, discovery=False)
    a = await make_node(bootstrap=p.listen_addrs, discovery=False, target_peers=1)
    pid_a, pid_q = a.dht.ctx.host.get_id(), q.dht.ctx.host.get_id()
    await wait_until(lambda: p.dht.dht.routing_table.peer_in_table(pid_q), 20,
                     what="Q in P's routing table")
    await wait_until(lambda: a.dht.dht.routing_table.peer_in_table(p.dht.ctx.host.get_id()),
                     20, what="P in A's routing table")
    held, release = await stall_dht(q)
    lookup = asyncio.create_task(a.find_providers(dht_key("checkpoint", "nobody/v3")))
    await wait_until(lambda: held, 20, what="A's query held by Q")

    async def dial_a() -> None:
        await q.dht.ctx.host.get_network().dial_addr(Multiaddr(a.listen_addrs[0]), pid_a)

    await q.dht.ctx.bridge.call(dial_a)
    await wait_until(lambda: len(a.dht.ctx.host.get_network().connections.get(pid_q, ())) >= 2,
                     20, what="A holding two connections to Q")
    await release()
    await asyncio.wait_for(lookup, 60)
    assert a.metrics["dht_connections_closed"] == 0
    assert q.peer_id in await connected(a)
