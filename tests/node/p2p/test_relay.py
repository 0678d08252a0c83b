"""Circuit Relay v2 between real hosts on loopback. A node listening on 127.0.0.x (x > 1)
dials out from 127.0.0.1, so peers see it where nothing listens: a NAT in miniature (its
dial-back fails, it is "unreachable" until it holds a relay slot)."""

from __future__ import annotations

import asyncio

import pytest
from swarm_node.node.identity import Identity
from swarm_node.node.p2p import P2PNode
from swarm_node.node.p2p import relay as relay_mod
from swarm_node.node.p2p.dht import DHTService
from swarm_node.node.p2p.reachability import Verdict

from .conftest import p2p_config, verdict, wait_until

HELLO = "/test/hello/1.0.0"


@pytest.fixture
async def natted():
    """Factory of started P2PNodes listening on 127.0.0.`host` (behind a "NAT")."""
    nodes = []

    async def make(host: int, bootstrap: list[str], *, discovery=True, **p2p):
        cfg = p2p_config(**p2p).with_overrides({"node.listen": [f"/ip4/127.0.0.{host}/tcp/0"]})
        node = P2PNode(Identity.generate(), cfg)
        await node.start(bootstrap=bootstrap, discovery=discovery)
        nodes.append(node)
        return node

    yield make
    await asyncio.gather(*(n.close() for n in nodes))


async def start_relay(**relay) -> P2PNode:
    cfg = p2p_config(hole_punching=False, **{f"relay.{k}": v
                                              for k, v in {"service": "on", **relay}.items()})
    node = P2PNode(Identity.generate(), cfg)
    await node.start(bootstrap=[])
    return node


async def test_relayed_connection_carries_gossip_and_requests(natted):
    """Also: a dial through the relay is not held up by a direct dial of the same peer."""
    relay = await start_relay()
    try:
        a = await natted(2, relay.listen_addrs, target_peers=1, hole_punching=False)
        await wait_until(lambda: a.reachability.verdict is Verdict.RELAYED, 30,
                         what="A relayed")
        circuit = a.reachability.relay_addrs[0]
        assert f"/p2p/{relay.peer_id}/p2p-circuit/p2p/{a.peer_id}" in circuit
        assert circuit in a.advertised_addrs()[:1]

        b = await natted(3, relay.listen_addrs, discovery=False, hole_punching=False)
        got: list = []

        async def on_verdict(env, origin):
            got.append((env.message.policy_version, origin))

        await a.subscribe("verdicts", on_verdict)
        async def ignore(env, origin) -> None:
            return None

        await b.subscribe("verdicts", ignore)

        async def hello(peer: str, body: bytes) -> bytes:
            return b"hello " + body + b" from " + a.peer_id.encode()

        await a.set_request_handler(HELLO, hello)
        # B is still dialling A at an address that never answers (a NAT'd peer's private
        # address: the dial waits out its timeout); the dial through the relay goes ahead
        # beside it instead of waiting for it to end
        held: list = []
        silent = await asyncio.start_server(lambda _r, w: held.append(w), "127.0.0.1", 0)
        port = silent.sockets[0].getsockname()[1]
        stuck = asyncio.create_task(b.connect(f"/ip4/127.0.0.1/tcp/{port}/p2p/{a.peer_id}",
                                              timeout=60))
        await wait_until(lambda: held, 10, what="B's first dial under way")
        assert await asyncio.wait_for(b.connect(circuit, timeout=60), 30) == a.peer_id
        assert not stuck.done()
        stuck.cancel()
        silent.close()
        assert b.is_relayed(a.peer_id)
        await wait_until(lambda: a.is_relayed(b.peer_id), 10, what="A sees B, relayed")
        assert await b.request(a.peer_id, HELLO, b"b") == b"hello b from " + a.peer_id.encode()
        await wait_until(lambda: a.peer_id in b.gossip.topic_peers("verdicts"), 20,
                         what="A's subscription over the relay")
        await b.publish("verdicts", verdict(7))
        await wait_until(lambda: got, 20, what="gossip over the relay")
        assert got == [(7, b.peer_id)]
        assert relay.health()["relay"]["circuits"] >= 1
    finally:
        await relay.close()


async def test_reservation_refused_past_the_relays_limit(natted, monkeypatch):
    monkeypatch.setattr(relay_mod, "RETRY_RELAY_S", 0.5)
    relay = await start_relay(max_reservations=1)
    try:
        a = await natted(2, relay.listen_addrs, target_peers=1, hole_punching=False)
        await wait_until(lambda: a.reachability.verdict is Verdict.RELAYED, 30, what="A")
        c = await natted(4, relay.listen_addrs, target_peers=1, hole_punching=False)
        await wait_until(lambda: c.metrics["relay_reservations_refused"] >= 1, 30,
                         what="C refused")
        assert c.reachability.verdict is Verdict.UNREACHABLE
        assert relay.health()["relay"]["reserved_peers"] == 1
        # A leaves: its slot is free at once (not after the reservation's TTL).
        await a.close()
        await wait_until(lambda: c.reachability.verdict is Verdict.RELAYED, 30,
                         what="C takes the freed slot")
    finally:
        await relay.close()


async def test_relayed_connection_upgrades_to_direct(natted):
    """DCUtR on loopback (its dials wait p2p.dial_timeout_s): the NATs are pretend, so its
    first step (a direct dial to the addresses identify gave) already succeeds. The real hole punch (TCP simultaneous open
    through two NATs) is test_hole_punch_through_two_nats in the namespace lab."""
    relay = await start_relay()
    try:
        a = await natted(2, relay.listen_addrs, target_peers=1, dial_timeout_s=4.0)
        # p2p.dial_timeout_s reaches DCUtR (py-libp2p's own default, 10 s, otherwise)
        assert a.relay.dcutr.dial_timeout == 4.0
        await wait_until(lambda: a.reachability.relay_addrs, 30, what="A relayed")
        b = await natted(3, relay.listen_addrs, discovery=False)
        await b.connect(a.reachability.relay_addrs[0])
        assert b.is_relayed(a.peer_id)
        await wait_until(lambda: not b.is_relayed(a.peer_id), 30, what="a direct connection")
        await wait_until(lambda: a.reachability.verdict is Verdict.DIRECT, 30,
                         what="A's verdict direct")
    finally:
        await relay.close()


async def test_a_natted_node_finds_a_relay_through_the_dht(natted, make_node):
    """A's one connection (target 1) is to P, which relays nothing; the relay R announced
    itself under the swarm's relay key (to P, the peer closest to it). A looks R up in the
    DHT, dials it and reserves a slot there."""
    relay = await start_relay()
    try:
        p = await make_node(bootstrap=relay.listen_addrs, discovery=False)
        await wait_until(lambda: relay.reachability.public, 30, what="the relay public")
        await relay.dht.provide_relay()
        assert relay.metrics["dht_provides"] >= 1
        a = await natted(2, p.listen_addrs, target_peers=1, hole_punching=False)
        await wait_until(lambda: a.reachability.verdict is Verdict.RELAYED, 60,
                         what="A relayed through the relay the DHT named")
        assert list(a.relay.reservations) == [relay.peer_id]
        assert a.metrics["relay_lookups"] == 1
    finally:
        await relay.close()


async def test_a_relay_slot_is_advertised_before_the_lookup_for_more(natted, monkeypatch):
    """Short of `relay.reservations` slots, the client looks up more relays in the DHT after
    reserving on the one it is connected to. That lookup can take long (~30 s in the NAT
    lab); the slot it holds is advertised at once, not when the lookup is done."""
    lookup_started, release = asyncio.Event(), asyncio.Event()

    async def slow_lookup(self, count: int = 8):
        lookup_started.set()
        await release.wait()
        return []

    monkeypatch.setattr(DHTService, "relays", slow_lookup)
    relay = await start_relay()
    try:
        a = await natted(2, relay.listen_addrs, target_peers=1, hole_punching=False,
                         **{"relay.reservations": 2})
        await wait_until(lambda: a.reachability.verdict is Verdict.RELAYED, 30,
                         what="A relayed while its lookup of more relays is pending")
        assert lookup_started.is_set() and not release.is_set()
        assert a.reachability.relay_addrs[0].endswith(f"/p2p-circuit/p2p/{a.peer_id}")
    finally:
        release.set()
        await relay.close()


def test_hole_punch_counters_count_a_peer_punched_by_either_side():
    """/status `relay.hole_punch`: py-libp2p's DCUtR bookkeeping has a peer as direct only on
    the side whose own dial won; on the other side that peer's attempt looks failed. The
    counters take the node's own view of its connections (a NAT'd peer held over a direct
    connection: `hole-punched`) as well. Logic over given bookkeeping; the punches themselves
    are test_relayed_connection_upgrades_to_direct and the namespace lab's."""
    from types import SimpleNamespace

    config = p2p_config()
    ctx = SimpleNamespace(cfg=config.p2p, config=config,
                          peers=SimpleNamespace(hole_punched_peers=lambda: {"won-there"}))
    service = relay_mod.RelayService(ctx, discovery=None)
    attempts = {"won-here": 1, "won-there": 1, "failing": 1,
                "ran-out": relay_mod.MAX_HOLE_PUNCH_ATTEMPTS, "trying": 2}
    stats = service._hole_punch_stats(attempts, {"trying"}, {"won-here"})
    assert stats == {"direct": 2, "failed": 2, "gave_up": 1, "in_progress": 1}
