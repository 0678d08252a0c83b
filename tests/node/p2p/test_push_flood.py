"""A many-identity push flood (issue 30): fresh identities, each a real node on its own
push link (node/p2p/gossip_push.py), push bodies nobody announced, each staying within the
per-pusher bound (32 held) while together they overrun the bound in all (1,024). An honest
body pushed ahead of its announce (as publishers do: the push often arrives first) must
still be there when the announce comes: the bound in all evicts from the largest holders,
not the oldest body. Plus the byte bounds, which the counts alone did not give (a body may
be 16 MiB: 32 per pusher was 512 MiB, 1,024 in all 16 GiB)."""

from __future__ import annotations

import asyncio
import hashlib
import os
import types

import pytest
from swarm_node.node.p2p import gossip_push
from swarm_node.node.p2p.bulk import BulkError
from swarm_node.node.p2p.gossip_push import (
    UNCLAIMED_BYTES_MAX,
    UNCLAIMED_BYTES_PER_PEER,
    UNCLAIMED_MAX,
    UNCLAIMED_PER_PEER,
    BodyPusher,
)
from swarm_node.node.p2p.metrics import P2PMetrics

from .conftest import rejects_by_sender, wait_until
from .test_gossip_push import frame, linked, raw_link
from .test_payload_plane import announce_of, batch

TOPIC = "rollouts"
SYBILS = 40  # x 32 held each > 1,024 in all
ROUNDS = 5  # honest bodies per phase


async def _honest_round(a, b, conn, got, k: int, flood_pushed) -> bool:
    """b pushes one body to a on its link `conn` ahead of its announce; once
    `flood_pushed()` more junk bodies than a holds in all came in after it (0 without a
    flood), b announces it. Returns whether a got it from the push (else a pulled it)."""
    body, ann, sealed = announce_of(b, batch(b.peer_id, 8192, k))
    claimed = a.metrics["payload_push_claimed"]
    await conn.write(frame(body))
    await wait_until(lambda: ann.content_hash in a.gossip.pusher.unclaimed, 30,
                     what="the honest push held")
    start = flood_pushed()
    await wait_until(lambda: flood_pushed() - start > UNCLAIMED_MAX
                     or not flood_pushed(), 60, what="the flood to overrun the bound")
    b.gossip.store_payload(ann.content_hash, body)
    await b.gossip.publish_raw(TOPIC, sealed)
    await wait_until(lambda: any(env.message.round == k for _, env in got), 30,
                     what=f"honest batch {k}")
    return a.metrics["payload_push_claimed"] > claimed


@pytest.mark.slow
async def test_many_identities_pushing_junk_cannot_evict_an_honest_push(make_node):
    # the bulk plane takes pushes from any authenticated peer, libp2p connection or not
    # (256 connections, 64 per address for unknown peers): here the sybils come from one
    # address as if from many, and connect over libp2p only to learn a's bulk endpoint, so
    # a's per-address and libp2p peer caps are raised for them
    a, b, got = await linked(make_node, bulk_conns_per_ip=512, bulk_pending_per_ip=512,
                             bulk_max_pending=512, max_peers=64)
    sybils = [await make_node(bootstrap=a.listen_addrs, discovery=False)
              for _ in range(SYBILS)]
    await wait_until(lambda: {s.peer_id for s in sybils} <= set(a.connected_peers()), 120,
                     what="the sybils connected")
    pushed = {"n": 0, "links": 0}
    stop = asyncio.Event()

    async def flood(node):
        while True:  # a hello refused or unanswered on this busy loop: again
            try:
                conn = await raw_link(node, a)
                break
            except BulkError:
                await asyncio.sleep(0.2)
        pushed["links"] += 1
        try:
            while not stop.is_set():  # fresh junk, unannounced: 40 x 100 bodies/s
                await conn.write(frame(os.urandom(4096)))
                pushed["n"] += 1
                await asyncio.sleep(0.01)  # paced: all of them share this process's loop
        finally:
            conn.abort()

    honest = await raw_link(b, a)  # b's long-lived link, as its own pusher keeps one
    baseline = [await _honest_round(a, b, honest, got, k, lambda: 0) for k in range(ROUNDS)]
    held_max = bytes_max = per_peer_max = 0

    def bounds() -> None:
        nonlocal held_max, bytes_max, per_peer_max
        p = a.gossip.pusher
        held_max = max(held_max, len(p.unclaimed))
        bytes_max = max(bytes_max, p.unclaimed_bytes)
        per_peer_max = max(per_peer_max, *p._per_peer.values(), 0)

    tasks = [asyncio.ensure_future(flood(s)) for s in sybils]
    try:
        # enough links that their 32 each overrun the bound in all
        await wait_until(lambda: pushed["links"] * UNCLAIMED_PER_PEER > UNCLAIMED_MAX + 64,
                         120, what="the sybils' push links")
        during = []
        for k in range(ROUNDS):
            during.append(await _honest_round(  # counted as they come in at a
                a, b, honest, got, 100 + k,
                lambda: (bounds(), a.metrics["payload_push_received"])[1]))
    finally:
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
    dropped = a.metrics["payload_push_unclaimed_dropped"]
    # after: the next honest push is claimed as before (the junk held stays bounded until
    # it expires or is evicted)
    after = [await _honest_round(a, b, honest, got, 200 + k, lambda: 0)
             for k in range(ROUNDS)]
    honest.abort()
    print(f"honest bodies delivered by push: baseline {sum(baseline)}/{ROUNDS}, flood "
          f"{sum(during)}/{ROUNDS}, after {sum(after)}/{ROUNDS}; flood pushed {pushed['n']} "
          f"junk bodies from {pushed['links']} of {SYBILS} identities, {dropped} dropped unclaimed; held at most "
          f"{held_max} bodies, {bytes_max >> 10} KiB, {per_peer_max} per pusher")
    assert sum(baseline) == ROUNDS
    assert sum(during) >= 0.8 * sum(baseline)
    assert sum(after) == ROUNDS
    assert pushed["n"] > UNCLAIMED_MAX * ROUNDS  # the flood did overrun the bound each round
    assert held_max <= UNCLAIMED_MAX and per_peer_max <= UNCLAIMED_PER_PEER
    assert bytes_max <= UNCLAIMED_BYTES_MAX
    assert dropped >= pushed["n"] - UNCLAIMED_MAX  # counted, not silently lost
    assert a.metrics["rejected"] == 0  # unannounced bodies are no offence


def _pusher() -> BodyPusher:
    metrics = P2PMetrics()
    return BodyPusher(types.SimpleNamespace(), None, metrics, max_size=lambda: 17 << 20,
                      held=lambda d: False, charge=lambda p, r: None,
                      spawn=lambda c, n: None, reachable=lambda: True, member=lambda p: True)


def test_unclaimed_bodies_are_bounded_in_bytes():
    """Byte bounds (logic; the hold path alone): 40 pushers each pushing 32 bodies of
    4 MiB hold at most 32 MiB each and 256 MiB in all, and the one honest 4-MiB body
    pushed first is still held at the end."""
    p = _pusher()
    big = bytes(4 << 20)  # one object: the bounds count lengths
    honest = hashlib.sha256(b"honest").digest()
    p._hold("honest", honest, big)
    for s in range(40):
        for i in range(32):
            p._hold(f"sybil-{s}", hashlib.sha256(f"{s}/{i}".encode()).digest(), big)
            assert p.unclaimed_bytes <= UNCLAIMED_BYTES_MAX
            assert p._bytes[f"sybil-{s}"] <= UNCLAIMED_BYTES_PER_PEER
    assert honest in p.unclaimed
    assert p.unclaimed_bytes == sum(len(u.data) for u in p.unclaimed.values())
    assert p.metrics["payload_push_unclaimed_dropped"] == 40 * 32 + 1 - len(p.unclaimed)
    assert p.claim(honest, len(big)) is big and p._bytes.get("honest") is None



async def test_bodies_being_read_are_bounded_in_all(make_node, monkeypatch):
    """Issue 30: a pushed body was read with `readexactly(size)`, so each push link could
    hold (and ask the socket for) up to the largest envelope, 16 MiB, before the hash
    check: N links, N x 16 MiB. Now a link's buffer holds what arrived and all links
    together at most READING_BYTES_MAX (here 1 MiB): three links that each claim a 4-MiB
    body and send ~400 KiB of it lose one, the one that read the most (counted, not
    charged), and an honest push on another link is still received."""
    monkeypatch.setattr(gossip_push, "READING_BYTES_MAX", 1 << 20, raising=False)
    a, b, _ = await linked(make_node)
    pusher = a.gossip.pusher
    conns = [await raw_link(b, a) for _ in range(3)]
    try:
        for i, conn in enumerate(conns):
            await conn.write(frame(b"", digest=os.urandom(32), size=4 << 20)
                             + os.urandom((400 << 10) + 1000 * i))
        await wait_until(lambda: a.metrics["payload_push_read_dropped"] >= 1, 30,
                         what="a read ended for the bound")
        # the two left hold ~800 KiB together: under the bound, so no second one ends
        assert a.metrics["payload_push_read_dropped"] == 1
        assert pusher.reading_bytes == sum(pusher._reading.values()) <= 1 << 20
        assert rejects_by_sender(a.metrics, b.peer_id) == {}
        received = a.metrics["payload_push_received"]
        honest = os.urandom(5000)
        conns.append(await raw_link(b, a))
        await conns[-1].write(frame(honest))
        await wait_until(lambda: a.metrics["payload_push_received"] > received, 30,
                         what="the honest push")
        assert hashlib.sha256(honest).digest() in pusher.unclaimed
    finally:
        for conn in conns:
            conn.abort()
