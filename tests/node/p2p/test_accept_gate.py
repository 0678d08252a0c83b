"""New inbound connections per subnet, checked at TCP accept before the Noise handshake
(admission.AcceptGate, patches/accept_gate.py; issue #30): real hosts on 127.0.0.1, where
every identity shares one address, with the gate's allowance scaled down from 16 at once
and 4 a second."""

from __future__ import annotations

import asyncio

import pytest
from libp2p.peer.id import ID
from swarm_node.node.p2p.admission import AcceptGate
from swarm_node.node.p2p.errors import DialError
from swarm_node.node.p2p.metrics import P2PMetrics
from swarm_node.protocol.limits import TopicRate

from .conftest import wait_until


def scale_down(node, *, burst: float, per_s: float, waiting: int, wait_s: float = 5.0):
    gate = node.admission.accept_gate
    gate.rate = TopicRate(per_s=per_s, burst=burst)
    gate.waiting, gate.wait_s = waiting, wait_s


async def seen_by(node, peer_id: str) -> bool:
    """Did `node`'s host ever learn `peer_id` (a handshake with it completed)?"""
    async def read() -> bool:
        return ID.from_base58(peer_id) in node.context.host.get_peerstore().peer_ids()

    return await node.context.bridge.call(read)


async def test_fresh_identities_past_the_allowance_are_refused_before_the_handshake(make_node):
    """Allowance 3 (and no refill, no waiting): an established peer and a first honest
    newcomer from 127.0.0.1 connect and say Hello; of 6 fresh identities then, 1 connects
    and 5 are closed at accept: the victim never completed a handshake with them (their
    peer IDs are unknown to its host). The established peer's connection stays and still
    answers. On py-libp2p alone all 6 connect."""
    victim = await make_node(discovery=False)
    scale_down(victim, burst=3, per_s=1e-6, waiting=0)
    established = await make_node(discovery=False)
    await established.connect(victim.listen_addrs[0])
    # Its connection must be tracked before it counts as established: a connection of an
    # established peer makes its address trusted (every identity here shares 127.0.0.1),
    # and under load the victim's notice of the connection can come after the dial returns.
    await wait_until(lambda: established.peer_id in victim.connected_peers(),
                     what="the victim tracked the established peer's connection")
    victim.set_established(lambda p: p == established.peer_id)
    newcomer = await make_node(discovery=False)
    await newcomer.connect(victim.listen_addrs[0])
    await newcomer.discovery.exchange(victim.peer_id)
    assert victim.peer_id in newcomer.discovery.known  # the Hello was answered

    assert not victim.admission.accept_gate.trusted("127.0.0.1")
    fresh = [await make_node(discovery=False) for _ in range(6)]
    await asyncio.gather(*(f.connect(victim.listen_addrs[0], timeout=10) for f in fresh),
                         return_exceptions=True)  # a refused dial may fail late or not at all
    await wait_until(lambda: victim.metrics["connections_refused_accept"]
                     + len(victim.connected_peers()) >= 8, what="every dial answered")
    refused = [f for f in fresh if f.peer_id not in victim.connected_peers()]
    assert len(refused) == 5
    assert victim.metrics["connections_refused_accept"] == 5
    for f in refused:
        assert not await seen_by(victim, f.peer_id)  # no handshake happened
        assert victim.peer_id not in f.connected_peers()
    assert established.peer_id in victim.connected_peers()
    await established.discovery.exchange(victim.peer_id)
    assert victim.peer_id in established.discovery.known


async def test_a_newcomer_behind_a_burst_waits_its_turn_and_connects(make_node):
    """Allowance 2 at once, then 4 a second: 8 identities dialling at once from one
    address all connect, 6 of them after waiting at accept for their subnet's turn (not
    refused); the victim upgraded them at the allowance's pace, not all at once."""
    victim = await make_node(discovery=False)
    scale_down(victim, burst=2, per_s=4.0, waiting=64)
    fresh = [await make_node(discovery=False) for _ in range(8)]
    results = await asyncio.gather(*(f.connect(victim.listen_addrs[0], timeout=10)
                                     for f in fresh), return_exceptions=True)
    assert all(isinstance(r, str) for r in results), results
    await wait_until(lambda: all(f.peer_id in victim.connected_peers() for f in fresh),
                     what="every identity connected")
    assert victim.metrics["connections_deferred_accept"] >= 6
    assert victim.metrics["connections_refused_accept"] == 0


async def test_a_dialer_that_gives_up_while_waiting_is_dropped_unread(make_node):
    """Allowance 1, then 1 a second, 10 s of waiting: a second identity whose dial times
    out (0.3 s) while it waits is closed as soon as its turn comes, before any handshake."""
    victim = await make_node(discovery=False)
    scale_down(victim, burst=1, per_s=1.0, waiting=64, wait_s=10.0)
    first = await make_node(discovery=False)
    await first.connect(victim.listen_addrs[0])
    quitter = await make_node(discovery=False)
    with pytest.raises(DialError):
        await quitter.connect(victim.listen_addrs[0], timeout=0.3)
    await quitter.close()
    await wait_until(lambda: victim.metrics["connections_gone_waiting"] == 1, 15,
                     what="the abandoned connection dropped")
    assert not await seen_by(victim, quitter.peer_id)


def test_the_allowance_is_per_subnet_and_trusted_addresses_skip_it():
    now = [0.0]
    gate = AcceptGate(P2PMetrics(), per_s=1.0, burst=2, clock=lambda: now[0])
    assert gate.allow("10.0.0.1") and gate.allow("10.0.0.2")
    assert not gate.allow("10.0.0.3")  # same /24: its 2 are spent
    assert gate.allow("10.0.1.1")  # another /24
    assert gate.allow("2001:db8:1:ff::1") and gate.allow("2001:db8:1:ee::2")
    assert not gate.allow("2001:db8:1:dd::3")  # same /48
    gate.trust("10.0.0.7")  # a peer with verified history connected from there
    assert all(gate.allow("10.0.0.7") for _ in range(5))
    assert not gate.allow("10.0.0.8")
    now[0] += 1.0
    assert gate.allow("10.0.0.8") and not gate.allow("10.0.0.9")  # 1 a second


def test_a_trusted_address_skips_its_subnets_waiting_line():
    import trio
    import trio.testing

    async def main() -> list[str]:
        gate = AcceptGate(P2PMetrics(), per_s=0.01, burst=1, wait_s=5.0)
        gate.trust("10.0.0.7")
        order: list[str] = []

        async def dial(ip: str) -> None:
            if await gate.t_admit(ip, lambda: False):
                order.append(ip)

        async with trio.open_nursery() as nursery:
            assert await gate.t_admit("10.0.0.1", lambda: False)  # the one token
            nursery.start_soon(dial, "10.0.0.2")  # waits ~100 s for the next
            await trio.testing.wait_all_tasks_blocked()
            await dial("10.0.0.7")  # at once, though its subnet has a waiter
            nursery.cancel_scope.cancel()
        return order

    assert trio.run(main) == ["10.0.0.7"]
