"""Discovery's state stays bounded under many identities (issue #30): `known` holds at most
MAX_KNOWN peers, a departed peer is redialled at most MAX_REDIAL_FAILURES times and then
forgotten until it is heard of again, bootstrap peers are never forgotten."""

from __future__ import annotations

import time
from types import SimpleNamespace

from swarm_node.node.identity import Identity
from swarm_node.node.lifecycle import TaskOwner
from swarm_node.node.p2p.discovery import (
    MAX_DIAL_ADDRS,
    MAX_KNOWN,
    MAX_PEERS_REPLY,
    MAX_REDIAL_FAILURES,
    MAX_UNREACHED_FAILURES,
    Discovery,
)
from swarm_node.node.p2p.errors import DialError
from swarm_node.protocol.codec import pack

from .conftest import p2p_config, wait_until


class _Answers:
    """The peer-exchange answers of every connected peer (the requests service seam)."""

    def __init__(self, entries: list):
        self.entries = entries

    async def request(self, peer, protocol, body, timeout, max_response):
        return pack(self.entries)


def _addr(pid: str) -> str:
    return f"/ip4/10.0.0.1/tcp/4001/p2p/{pid}"


def _discovery(connected: set[str], answers: _Answers, reachable: set[str], tasks=None):
    """A Discovery over fakes: `connected` peers, dials that reach only `reachable`."""
    cfg = p2p_config()

    async def connect(addr: str, timeout: float | None = None) -> str:
        pid = addr.rsplit("/p2p/", 1)[1]
        if pid not in reachable:
            raise DialError(f"{addr}: connection refused", reason="refused")
        connected.add(pid)
        return pid

    ctx = SimpleNamespace(cfg=cfg.p2p, config=cfg, peer_id="me", swarm_id=cfg.node.swarm_id,
                          spawn=tasks.spawn if tasks is not None else None,
                          metrics=SimpleNamespace(inc=lambda *a, **k: None),
                          penalties=SimpleNamespace(refused=lambda p: False),
                          peers=SimpleNamespace(advertised_addrs=list, connect=connect,
                                                connected_peers=lambda: sorted(connected)))
    return Discovery(ctx, answers, dht=_DHT([]))


class _DHT:
    """Swarm peers the DHT names."""

    def __init__(self, records: list):
        self.records = records

    async def swarm_peers(self, count: int = 20):
        return self.records


async def test_known_stays_within_its_bound_when_exchanges_name_more_identities():
    """Exchanges naming 20 x 63 fresh identities (more than MAX_KNOWN) leave `known` at
    MAX_KNOWN; what goes first is a peer whose redial failed, then the one heard of longest
    ago; the connected peers and the bootstrap peer stay, and the newest identities are
    kept."""
    connected: set[str] = set()
    answers = _Answers([["T", [_addr("T")]], ["C", [_addr("C")]], ["B", [_addr("B")]],
                        ["F", [_addr("F")]], ["old", [_addr("old")]]])
    d = _discovery(connected, answers, reachable={"T", "C", "B"})
    assert await d.bootstrap([_addr("B")]) == ["B"]
    connected.discard("B")  # the bootstrap peer left; T and C stay connected
    connected |= {"T", "C"}
    await d.exchange("T")
    await d._redial("F", [_addr("F")], frozenset([_addr("F")]))  # F's redial fails
    assert d._next_try["F"] > time.monotonic()
    assert list(d.known) == ["T", "C", "B", "F", "old"]
    flood = [f"sybil{i}" for i in range(20 * (MAX_PEERS_REPLY - 1))]
    assert len(flood) > MAX_KNOWN
    for i in range(0, len(flood), MAX_PEERS_REPLY - 1):
        answers.entries = [["T", [_addr("T")]]] + [[p, [_addr(p)]] for p in
                                                   flood[i:i + MAX_PEERS_REPLY - 1]]
        await d.exchange("T")
        assert len(d.known) <= MAX_KNOWN
    assert len(d.known) == MAX_KNOWN
    assert {"T", "C", "B"} <= set(d.known)  # connected now, bootstrap
    assert "F" not in d.known and "old" not in d.known and "F" not in d._next_try
    assert set(flood[-(MAX_KNOWN - 3):]) <= set(d.known)  # the newest kept
    assert d.evicted == len(flood) + 5 - MAX_KNOWN
    assert len(d._backoff) <= len(d.known)


async def test_bootstrap_peers_are_never_forgotten():
    """The bootstrap peer and a peer it named both leave: the named peer, which no dial of
    ours ever reached, is forgotten after MAX_UNREACHED_FAILURES failed redials; the
    bootstrap peer is still known and dialled after 2 x MAX_REDIAL_FAILURES."""
    connected: set[str] = set()
    answers = _Answers([["B", [_addr("B")]], ["X", [_addr("X")]]])
    tasks, reachable = TaskOwner("test"), {"B"}
    d = _discovery(connected, answers, reachable=reachable, tasks=tasks)
    try:
        assert await d.bootstrap([_addr("B")]) == ["B"]
        assert set(d.known) == {"B", "X"}
        connected.clear()  # both gone
        reachable.clear()
        for i in range(2 * MAX_REDIAL_FAILURES):
            assert ("X" in d.known) == (i < MAX_UNREACHED_FAILURES)
            for pid in list(d.known):
                await d._redial(pid, [_addr(pid)], frozenset([_addr(pid)]))
        assert "X" not in d.known and d.forgotten == 1
        assert d.known == {"B": [_addr("B")]}
        d._next_try.clear()  # its backoff over
        assert await d.fill() == 1 and "B" in d._dials  # still dialled
    finally:
        await tasks.close()


async def test_a_dht_record_of_a_forgotten_peer_is_not_word_of_it():
    """A DHT record naming a forgotten peer at the addresses it was forgotten with does not
    bring it back (records outlive their peers); one naming other addresses does."""
    connected: set[str] = {"T"}
    answers = _Answers([["T", [_addr("T")]], ["X", [_addr("X")]]])
    d = _discovery(connected, answers, reachable={"T"})
    await d.exchange("T")
    answers.entries = [["T", [_addr("T")]]]  # X left: T no longer names it
    for _ in range(MAX_REDIAL_FAILURES):
        await d._redial("X", [_addr("X")], frozenset([_addr("X")]))
    assert "X" not in d.known
    d.dht = _DHT([("X", [_addr("X")])])
    assert await d._from_dht(set()) == [] and "X" not in d.known
    moved = "/ip4/10.0.0.2/tcp/4001/p2p/X"
    d.dht.records = [("X", [moved])]
    d._dht_looked -= 3600  # the next lookup is due
    assert await d._from_dht(set()) == [("X", [moved])] and d.known["X"] == [moved]


async def test_a_departed_peer_is_forgotten_after_its_redials_and_dialled_again_when_named(
        make_node, tmp_path):
    """Real hosts: A hears of B from C and dials it. B leaves: A redials it at most
    MAX_REDIAL_FAILURES times (a peer A's dial reached; each redial at most MAX_DIAL_ADDRS
    addresses), then forgets it and dials it no more. B comes back (same key, new port) and C names it again: A dials it."""
    a = await make_node(reconnect_max_backoff_s=2)
    c = await make_node(bootstrap=a.listen_addrs, reconnect_max_backoff_s=2)
    key = tmp_path / "b.pem"
    b = await make_node(identity=Identity.load_or_create(key), bootstrap=c.listen_addrs,
                        discovery=False)  # B dials nobody but C: A must dial it
    dials: list[str] = []
    connect = a.connect

    async def counted(addr: str, timeout: float | None = None) -> str:
        if addr.endswith(f"/p2p/{b.peer_id}"):
            dials.append(addr)
        return await connect(addr, timeout=timeout)

    a.connect = counted  # the seam discovery dials through (ctx.peers is the node)
    await wait_until(lambda: b.peer_id in a.connected_peers(), 60, what="A dialled B")
    assert dials
    await b.close()
    await wait_until(lambda: b.peer_id not in a.connected_peers()
                     and b.peer_id not in c.connected_peers(), 30, what="B's departure seen")
    dials.clear()
    await wait_until(lambda: b.peer_id not in a.discovery.known, 90, what="A forgot B")
    assert 1 <= len(dials) <= MAX_REDIAL_FAILURES * MAX_DIAL_ADDRS, dials
    assert a.discovery.forgotten >= 1
    before = len(dials)
    await a.discovery.fill()
    assert len(dials) == before and b.peer_id not in a.discovery._dials  # no more dials

    again = await make_node(identity=Identity.load(key), bootstrap=c.listen_addrs,
                            discovery=False)
    await wait_until(lambda: again.peer_id in a.connected_peers(), 60, what="A dialled B again")
    port = again.listen_addrs[0].split("/tcp/")[1].split("/")[0]
    assert len(dials) > before and f"/tcp/{port}/" in dials[-1]
