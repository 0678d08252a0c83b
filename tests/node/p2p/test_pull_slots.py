"""Announced-payload pull slots (node/p2p/pubsub.py PullSlots): one announcer holds at most
half of them, so a stalling announcer's pulls do not make another announcer's wait; and all
unproven announcers together hold at most half, so many stalling identities do not make the
pulls of an announcer that served us wait."""

from __future__ import annotations

import asyncio
import struct

import pytest
from swarm_node.node.p2p import pubsub
from swarm_node.node.p2p.bodies import KIND as BODY
from swarm_node.node.p2p.pubsub import PullSlots
from swarm_node.protocol.ids import FETCH_PROTOCOL

from .conftest import drop_warm_connection, rejects_by_sender, wait_until
from .test_payload_plane import KIND, announce_of, batch


async def test_a_stalling_announcer_does_not_delay_an_honest_announcers_body(
        make_node, monkeypatch):
    # b receives; a announces 6 bodies and stalls every pull; c announces one honestly
    p2p = {"payload_pull_timeout_s": 20.0}  # a's pulls stay held for the whole test
    monkeypatch.setattr(pubsub, "FIRST_ANSWER_S", 20.0)  # (its first answer is due no sooner)
    b = await make_node(**p2p)
    a = await make_node(bootstrap=b.listen_addrs, **p2p)
    c = await make_node(bootstrap=b.listen_addrs, **p2p)
    got = []

    async def on_msg(env, peer):
        got.append(env)

    for node in (a, b, c):
        await node.subscribe(KIND, on_msg if node is b else _ignore)
    await wait_until(lambda: {a.peer_id, c.peer_id} <= set(b.gossip.mesh_peers(KIND)), 30,
                     what="the mesh")
    asked = []

    async def stall(peer, conn):  # takes requests, never answers
        asked.append(await conn.readexactly(32))
        await conn.read(1)  # until the puller gives up

    a.bulk.register(BODY, stall)
    await drop_warm_connection(b, a)  # b's pulls from a on connections the stall handles
    stalled = 6
    for round_ in range(1, stalled + 1):
        _, _, sealed_ann = announce_of(a, batch(a.peer_id, 8192, round_))
        await a.gossip.publish_raw(KIND, sealed_ann)
    slots = b.gossip.pull_slots
    # a is unproven (it never served b): one of its pulls is held, the others queue
    await wait_until(lambda: slots.pulls(a.peer_id) == stalled and len(asked) >= 1, 30,
                     what="a's pulls waiting")
    honest = batch(c.peer_id, 8192, 1)
    await c.publish(KIND, honest)  # above the inline threshold: announced
    await wait_until(lambda: len(got) == 1, 60, what="c's body")
    assert got[0].message == honest
    # delivered while every one of a's pulls is still stalled or queued, none timed out
    # (with a share of all 4 slots, c's body came after a's first pull timeout:
    # 'assert 1 == 0')
    assert b.metrics["rejected.unserved_announce"] == 0
    assert slots.pulls(a.peer_id) == stalled


async def _ignore(env, peer) -> None:
    return None


async def test_one_announcers_pulls_are_capped_and_queued_in_order():
    slots = PullSlots(4, queued=2)
    slots.served("a")  # both served us before: each may hold its share, not only one slot
    slots.served("b")
    order: list[str] = []
    release = asyncio.Event()

    async def pull(announcer: str, tag: str) -> None:
        slot = slots.claim(announcer)
        assert slot is not None
        async with slot:
            order.append(tag)
            if announcer == "a":
                await release.wait()

    tasks = [asyncio.create_task(pull("a", f"a{i}")) for i in range(4)]
    await wait_until(lambda: order == ["a0", "a1"], 5, what="a's share taken")
    assert slots.claim("a") is None  # 2 holding + 2 queued: its queue is full
    await pull("b", "b0")  # another announcer takes a free slot at once
    assert order == ["a0", "a1", "b0"]
    release.set()
    await asyncio.gather(*tasks)
    assert order == ["a0", "a1", "b0", "a2", "a3"]
    assert slots.pulls("a") == 0 and slots.pulls("b") == 0 and not slots._announcers


async def test_share_is_half_the_slots_at_least_one():
    assert [PullSlots(n).per_announcer for n in (1, 2, 3, 4, 9)] == [1, 1, 1, 2, 4]


async def test_stalling_identities_hold_only_the_unproven_half_of_the_slots(
        make_node, monkeypatch):
    # b receives. c has served b before (proven). s1 and s2, two fresh identities, announce
    # 3 bodies each and stall every pull: together they would hold all 4 slots (2 each)
    p2p = {"payload_pull_timeout_s": 20.0}  # their pulls stay held for the whole test
    monkeypatch.setattr(pubsub, "FIRST_ANSWER_S", 20.0)  # (their first answer is due no sooner)
    b = await make_node(**p2p)
    c = await make_node(bootstrap=b.listen_addrs, **p2p)
    stallers = [await make_node(bootstrap=b.listen_addrs, **p2p) for _ in range(2)]
    got = []

    async def on_msg(env, peer):
        got.append(env)

    for node in (b, c, *stallers):
        await node.subscribe(KIND, on_msg if node is b else _ignore)
    await wait_until(lambda: {c.peer_id, *(s.peer_id for s in stallers)}
                     <= set(b.gossip.mesh_peers(KIND)), 30, what="the mesh")
    first = batch(c.peer_id, 8192, 1)
    await c.publish(KIND, first)  # above the inline threshold: announced, pulled, verified
    await wait_until(lambda: len(got) == 1, 30, what="c's first body")
    slots = b.gossip.pull_slots
    assert slots.proven(c.peer_id)
    asked = []  # b's requests (c and the other staller pull the announced bodies too)

    async def stall(peer, conn):  # takes requests, never answers
        digest = await conn.readexactly(32)
        if peer == b.peer_id:
            asked.append(digest)
        await conn.read(1)  # until the puller gives up

    for s in stallers:
        s.bulk.register(BODY, stall)
        await drop_warm_connection(b, s)
        for round_ in range(1, 4):
            _, _, sealed_ann = announce_of(s, batch(s.peer_id, 8192, round_))
            await s.gossip.publish_raw(KIND, sealed_ann)
    await wait_until(lambda: all(slots.pulls(s.peer_id) == 3 for s in stallers)
                     and len(asked) >= 2, 30, what="the stalled pulls")
    second = batch(c.peer_id, 8192, 2)
    await c.publish(KIND, second)
    await wait_until(lambda: len(got) == 2, 60, what="c's second body")
    assert got[1].message == second
    # while both stallers' pulls are still held or queued (none timed out), and they held 2
    # slots between them, not 4 (all 4: 'assert 4 == 2', and c's body after a timeout)
    assert b.metrics["rejected.unserved_announce"] == 0
    assert len(asked) == 2
    assert not any(slots.proven(s.peer_id) for s in stallers)


async def test_unproven_announcers_share_half_the_slots_and_a_failure_unproves():
    slots = PullSlots(4)
    slots.served("honest")
    held: list[str] = []
    release = asyncio.Event()

    async def pull(announcer: str) -> None:
        async with slots.claim(announcer):
            held.append(announcer)
            await release.wait()

    tasks = [asyncio.create_task(pull(a)) for a in ("x", "x", "y", "y", "z")]
    # each pull took its place in one step (a free slot is taken without a wait): once all
    # five are counted, every slot they could take is taken
    await wait_until(lambda: sum(map(slots.pulls, "xyz")) == 5, 5, what="five pulls")
    assert sorted(held) == ["x", "y"]  # x, y and z wait for the unproven half, not all 4
    tasks += [asyncio.create_task(pull("honest")) for _ in range(2)]
    await wait_until(lambda: held.count("honest") == 2, 5, what="the proven half")
    release.set()
    await asyncio.gather(*tasks)
    slots.failed("honest")
    assert not slots.proven("honest")
    assert [PullSlots(n)._unproven._value for n in (1, 2, 4, 9)] == [1, 1, 2, 4]


async def test_an_unserved_announcer_loses_its_place_at_once_until_it_serves(monkeypatch):
    slots = PullSlots(2)  # one unproven slot
    release = asyncio.Event()
    went: list[bool] = []

    async def pull(announcer: str) -> None:
        async with slots.claim(announcer) as go:
            went.append(go)
            if go:
                await release.wait()

    first = asyncio.create_task(pull("x"))
    await wait_until(lambda: went == [True], 5, what="x's first pull")
    queued = asyncio.create_task(pull("x"))  # waits for x's one unproven slot
    await wait_until(lambda: slots.pulls("x") == 2, 5, what="x's second pull queued")
    slots.unserved("x")  # the first pull was not served
    release.set()
    await asyncio.gather(first, queued)
    assert went == [True, False]  # the queued pull gave its place up, holding no slot
    assert slots.stalled("x") and slots._unproven._value == 1
    length = slots._stalled["x"][1]
    slots.unserved("x")  # a trial after the stall, unserved again: twice as long
    assert slots._stalled["x"][1] == 2 * length
    slots.served("x")  # a body it served (pushed or pulled elsewhere) ends it
    assert not slots.stalled("x")
    monkeypatch.setattr(pubsub, "STALL_S", 0.0)  # a stall that has run out: one trial
    slots.unserved("y")
    assert not slots.stalled("y")


@pytest.mark.parametrize("plane", ["bulk", "libp2p"])
async def test_fresh_stalling_announcers_hold_an_unproven_slot_only_until_their_first_answer_is_due(
        make_node, plane):
    # b receives with one unproven pull slot; s1 and s2, fresh identities on direct
    # connections, announce a body each and never answer (on the bulk plane, or on libp2p
    # streams with the bulk plane off); then newcomer n announces one. The pull and request
    # timeouts are far beyond the test: only the first-answer deadline
    # (pubsub.FIRST_ANSWER_S) ends the stallers' pulls.
    p2p = {"payload_pull_timeout_s": 600.0, "payload_fetch_parallel": 2,
           "payload_push_fanout": 0, "request_timeout_s": 600.0,
           "bulk_fetch": plane == "bulk"}
    b = await make_node(**p2p)
    n = await make_node(bootstrap=b.listen_addrs, **p2p)
    stallers = [await make_node(bootstrap=b.listen_addrs, **p2p) for _ in range(2)]
    got = []

    async def on_msg(env, peer):
        got.append(env)

    for node in (b, n, *stallers):
        await node.subscribe(KIND, on_msg if node is b else _ignore)
    await wait_until(lambda: {n.peer_id, *(s.peer_id for s in stallers)}
                     <= set(b.gossip.mesh_peers(KIND)), 30, what="the mesh")
    asked = []

    async def stall(peer, conn):  # takes requests, never answers
        digest = await conn.readexactly(32)
        if peer == b.peer_id:
            asked.append(digest)
        await conn.read(1)  # until the puller gives up

    async def stall_request(peer, digest):  # the same on libp2p streams
        if peer == b.peer_id:
            asked.append(digest)
        await asyncio.Event().wait()

    slots = b.gossip.pull_slots
    for s in stallers:
        if plane == "bulk":
            s.bulk.register(BODY, stall)
            await drop_warm_connection(b, s)
        else:
            await s.requests.set_request_handler(FETCH_PROTOCOL, stall_request)
        _, _, sealed_ann = announce_of(s, batch(s.peer_id, 8192, 1))
        await s.gossip.publish_raw(KIND, sealed_ann)
        await wait_until(lambda s=s: slots.pulls(s.peer_id) == 1, 30,
                         what="the staller's pull")
    honest = batch(n.peer_id, 8192, 1)
    await n.publish(KIND, honest)  # queued behind both stallers' pulls
    # (before, the first staller held the one unproven slot for the pull timeout: 'timed
    # out after 60 s waiting for the newcomer's body')
    await wait_until(lambda: len(got) == 1, 60, what="the newcomer's body")
    assert got[0].message == honest
    for s in stallers:  # each charged once for the stall, as a timed-out pull is
        assert rejects_by_sender(b.metrics, s.peer_id) == {"unserved_announce": 1}
        assert slots.stalled(s.peer_id) and not slots.proven(s.peer_id)
    assert len(set(asked)) == 2 and slots.proven(n.peer_id)  # (a hedge asks the other too)
    assert rejects_by_sender(b.metrics, n.peer_id) == {}


async def test_a_slow_honest_announcer_is_not_cut_short_by_the_first_answer_deadline(
        make_node, monkeypatch):
    # a serves its bodies slowly: its first while unproven (the answer begins at once, the
    # body comes 5 deadlines later: a large body on a slow uplink), its second once proven
    # (the answer begins 5 deadlines late). Both delivered, nothing charged.
    monkeypatch.setattr(pubsub, "FIRST_ANSWER_S", 0.2)
    p2p = {"payload_pull_hedge_s": 0.1, "payload_push_fanout": 0}  # deadline 0.2 s
    b = await make_node(**p2p)
    a = await make_node(bootstrap=b.listen_addrs, **p2p)
    got = []

    async def on_msg(env, peer):
        got.append(env)

    for node in (a, b):
        await node.subscribe(KIND, on_msg if node is b else _ignore)
    await wait_until(lambda: a.peer_id in b.gossip.mesh_peers(KIND), 30, what="the mesh")
    bodies: dict[bytes, bytes] = {}
    late = 5 * pubsub.FIRST_ANSWER_S  # the peer's slowness, not a wait of the test

    async def slow(peer, conn):
        while True:
            try:
                digest = await conn.readexactly(32)
            except asyncio.IncompleteReadError:
                return
            body = bodies[digest]
            proven = b.gossip.pull_slots.proven(a.peer_id)
            if proven:
                await asyncio.sleep(late)
            await conn.write(struct.pack(">BI", 0, len(body)))
            if not proven:
                await asyncio.sleep(late)
            await conn.write(body)

    a.bulk.register(BODY, slow)
    await drop_warm_connection(b, a)
    sent = []
    for round_ in (1, 2):
        message = batch(a.peer_id, 8192, round_)
        body, ann, sealed_ann = announce_of(a, message)
        bodies[ann.content_hash] = body
        sent.append(message)
        await a.gossip.publish_raw(KIND, sealed_ann)
        await wait_until(lambda r=round_: len(got) == r, 30, what=f"body {round_}")
    assert [env.message for env in got] == sent
    assert rejects_by_sender(b.metrics, a.peer_id) == {}
    assert b.metrics["payload_fetch_failed"] == 0
