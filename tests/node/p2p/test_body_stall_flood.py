"""Many identities announce gossip bodies and never serve them (issue 30 item 3, "24
identities that announce gossip bodies and never serve them were not cut in 180 s: an
established peer's rate fell from 91.9/s to 30.2/s and a newcomer never got a rollout
accepted"), against real libp2p hosts on 127.0.0.1: each stalling announcer loses its
place after its first unserved pull (pubsub.py PullSlots, STALL_S), the established
announcer's bodies keep coming during and after at its own rate before, and a newcomer's
first body is pulled and delivered behind nothing but the stallers' first pulls.

STALLERS is as many hosts as this process runs beside the test's three without its
harness timing out on a loaded 2-core machine: test_sybil_floods runs 20 (a 3 s dial and
a 5 s bootstrap ran out in CI with them); the issue used 24."""

from __future__ import annotations

import asyncio
import itertools

import pytest
from swarm_node.node.p2p import pubsub
from swarm_node.node.p2p.bodies import KIND as BODY

from .attacks import MESHSUB, signed_rpcs
from .conftest import ignore, rejects_by_sender, wait_until
from .test_payload_plane import KIND, announce_of, batch

STALLERS = 20
ROUNDS = 10  # the established announcer's bodies per phase (one after another)
P2P = {
    # every body pulled (publishers push nothing), 4 of 8 slots for unproven announcers
    # (the default 16 holds 8: 20 stallers are 2.5 rounds of them, as 24 were 3 of 8)
    "payload_push_fanout": 0, "payload_fetch_parallel": 8,
    # a stalled pull holds its slot this long: the harness's pace, not a claim
    "payload_pull_timeout_s": 3.0, "dial_timeout_s": 10,
}


async def _phase(established, got, first: int) -> float:
    """ROUNDS bodies of `established`, each published once the one before arrived; the
    bodies per second of the receiver's clock."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    for k in range(first, first + ROUNDS):
        await established.publish(KIND, batch(established.peer_id, 8192, k))
        await wait_until(lambda k=k: (established.peer_id, k) in got, 60,
                         what=f"the established body {k}")
    return ROUNDS / (loop.time() - start)


@pytest.mark.slow
async def test_many_stalling_announcers_lose_their_place_and_a_newcomer_is_served(
        make_node, monkeypatch):
    # a stall long enough that none ends within the test, whatever its pace (30 s by
    # default: the count below would then depend on how fast this machine is)
    monkeypatch.setattr(pubsub, "STALL_S", 600.0)
    receiver = await make_node(discovery=False, **P2P)
    established = await make_node(bootstrap=receiver.listen_addrs, discovery=False, **P2P)
    newcomer = await make_node(bootstrap=receiver.listen_addrs, discovery=False, **P2P)
    stallers = [await make_node(bootstrap=receiver.listen_addrs, discovery=False, **P2P)
                for _ in range(STALLERS)]
    got: set[tuple[str, int]] = set()

    async def on_msg(env, origin):
        got.add((origin, env.message.round))

    await receiver.subscribe(KIND, on_msg)
    for node in (established, newcomer):
        await node.subscribe(KIND, ignore)
    await wait_until(lambda: {established.peer_id, newcomer.peer_id}
                     <= set(receiver.gossip.mesh_peers(KIND)), 30, what="the mesh")
    slots = receiver.gossip.pull_slots
    base = await _phase(established, got, 0)
    assert slots.proven(established.peer_id)

    own: dict[str, set[bytes]] = {s.peer_id: set() for s in stallers}  # each one's bodies
    asked: dict[str, int] = dict.fromkeys(own, 0)  # the receiver's pulls of them from them

    def stall_for(staller):
        async def stall(peer, conn):  # takes requests, never answers
            digest = await conn.readexactly(32)
            if peer == receiver.peer_id and digest in own[staller.peer_id]:
                asked[staller.peer_id] += 1
            await conn.read(1)  # until the puller gives up
        return stall

    # the receiver warmed a body connection to each at connect time: closed, so that its
    # pulls open connections the stall handles
    await wait_until(lambda: receiver.metrics["payload_bulk_warmed"]
                     + receiver.metrics["payload_bulk_warm_failed"] >= STALLERS + 2, 60,
                     what="the warm-ups")
    streams = {}
    for s in stallers:
        s.bulk.register(BODY, stall_for(s))
        receiver.bulk.client.forget_idle(s.peer_id, BODY)
        streams[s.peer_id] = await s.open_stream(receiver.peer_id, MESHSUB)

    stop = asyncio.Event()

    async def flood() -> None:  # each staller announces a new body every ~0.5 s
        for i in itertools.count():
            for s in stallers:
                if stop.is_set():
                    return
                _, ann, sealed = announce_of(s, batch(s.peer_id, 8192, i))
                own[s.peer_id].add(ann.content_hash)
                await streams[s.peer_id].write(
                    signed_rpcs(s, s.topic(KIND), [sealed])[0])
                await asyncio.sleep(0.5 / STALLERS)  # the flood's pace, not a wait

    def unserved(s) -> int:
        return rejects_by_sender(receiver.metrics, s.peer_id).get("unserved_announce", 0)

    flooding = asyncio.ensure_future(flood())
    try:
        during = await _phase(established, got, ROUNDS)
        await wait_until(lambda: all(unserved(s) >= 1 for s in stallers), 120,
                         what="a pull of every staller's body unserved")
        # the newcomer's first body, while the stallers go on announcing
        await newcomer.publish(KIND, batch(newcomer.peer_id, 8192, 0))
        # (on the code before, its pull queued behind the stallers' next pulls in the
        # unproven half: 'timed out after 60 s waiting for the newcomer's body')
        await wait_until(lambda: (newcomer.peer_id, 0) in got, 60, what="the newcomer's body")
        asks = dict(asked)
        announced = sum(map(len, own.values()))
    finally:
        stop.set()
        await flooding
    # after: the rate returns, within a few phases (one phase is 10 bodies in a row: a
    # moment's load from the machine's other work, CI's other test workers, moves it by 2-3x)
    after = 0.0
    for first in range(2 * ROUNDS, 6 * ROUNDS, ROUNDS):
        after = max(after, await _phase(established, got, first))
        if after >= 0.8 * base:
            break
    print(f"{STALLERS} stallers announced {announced} bodies; the receiver pulled "
          f"{sum(asks.values())} of them (per staller {sorted(set(asks.values()))}), "
          f"skipped {receiver.metrics['payload_pull_stalled_announcer']}; established "
          f"bodies/s before {base:.1f}, during {during:.1f}, after {after:.1f}")
    # each staller's bodies were pulled from it once: its first unserved pull cost it its
    # place (before: one pull per announce, one at a time, until its queue of 256 was full)
    assert sorted(set(asks.values())) == [1]
    assert receiver.metrics["payload_pull_stalled_announcer"] > 0  # announces not pulled
    assert not any(slots.proven(s.peer_id) for s in stallers)
    # the established announcer's bodies: all came, at half its rate before at least
    # during (the flood's 20 hosts share these 2 cores with it) and at 80% after
    assert during >= 0.5 * base and after >= 0.8 * base
