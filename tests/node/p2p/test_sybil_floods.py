"""Floods from many identities, each under its per-origin limit, against real libp2p hosts
on 127.0.0.1 (issue 30 items 1 and 2): the honest relay that carries the flood is never cut
(nor by a peer that joins mid-flood and gets the relay's catch-up burst), honest messages
keep arriving during and after it, the work left behind is bounded, and a newcomer can
still connect once the identities came and went."""

from __future__ import annotations

import asyncio

import pytest
from swarm_node.protocol.messages import ShardAdvert

from .attacks import MESHSUB, signed_rpcs
from .conftest import ignore, verdict, wait_until
from .test_gossip import rollout_batch

FLOODS = {
    # kind: (identities, messages per identity, per second each): each identity under the
    # per-peer limit (50/s verdicts and rollouts, 20/s adverts), their sum far over it
    "verdicts": (20, 80, 10.0),
    "rollouts": (20, 80, 10.0),
    "adverts": (8, 64, 8.0),
}


def _message(kind: str, origin: str, i: int):
    if kind == "verdicts":
        return verdict(i)
    if kind == "rollouts":
        return rollout_batch(origin, 200, i)
    return ShardAdvert(policy_id=origin, version=1000 + i, complete=True)  # "future" versions


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(FLOODS))
async def test_a_relay_carrying_a_many_identity_flood_is_never_cut(make_node, kind):
    identities, per_identity, rate = FLOODS[kind]
    victim = await make_node(discovery=False)
    relay = await make_node(bootstrap=victim.listen_addrs, discovery=False)
    honest = await make_node(bootstrap=relay.listen_addrs, discovery=False)
    # each identity its own connection to the relay (as sybil peers): the relay forwards
    # all of them to the victim, which must not take it for the flooder
    sybils = [await make_node(bootstrap=relay.listen_addrs, discovery=False)
              for _ in range(identities)]
    got: dict[str, int] = {}

    async def count(env, origin):
        got[origin] = got.get(origin, 0) + 1

    for node in (victim, relay, honest):
        await node.subscribe(kind, count)
    await wait_until(lambda: honest.peer_id in relay.gossip.topic_peers(kind)
                     and relay.peer_id in victim.gossip.topic_peers(kind), 30, what="the topic")
    frames = [(s, signed_rpcs(s, s.topic(kind), [s.identity.seal(_message(kind, s.peer_id, i))])[0])
              for i in range(per_identity) for s in sybils]  # round robin over identities
    streams = {s.peer_id: await s.open_stream(relay.peer_id, MESHSUB) for s in sybils}
    loop = asyncio.get_running_loop()
    start = loop.time()
    sent_honest = 0
    joiner = None
    for j, (sybil, frame) in enumerate(frames):  # identities x rate messages/s in all
        await streams[sybil.peer_id].write(frame)
        if j == len(frames) // 3:  # a peer joins mid-flood: the relay's catch-up burst
            joiner = await make_node(bootstrap=relay.listen_addrs, discovery=False)
            await joiner.subscribe(kind, ignore)
        if j % (identities * 2) == 0:  # the honest origin: one message per ~0.2 s
            await honest.publish(kind, _message(kind, honest.peer_id, 10_000 + sent_honest))
            sent_honest += 1
        # the flood's pace (frame j leaves at j / (identities x rate) s), not a wait
        await asyncio.sleep(max(0.0, start + (j + 1) / (identities * rate) - loop.time()))
    during = got.get(honest.peer_id, 0)
    # after: honest traffic is back in full, without a restart
    for i in range(10):
        await honest.publish(kind, _message(kind, honest.peer_id, 20_000 + i))
    await wait_until(lambda: got.get(honest.peer_id, 0) >= sent_honest + 10, 30,
                     what="every honest message after the flood")
    assert during >= 0.8 * sent_honest, (during, sent_honest)  # ... and >= 80% during it
    assert relay.peer_id in victim.connected_peers()
    assert victim.penalties.cuts == 0 and relay.penalties.cuts == 0
    assert relay.peer_id not in victim.health()["refused"]
    assert joiner.penalties.cuts == 0 and relay.peer_id in joiner.connected_peers()
    flooded = sum(n for origin, n in got.items() if origin != honest.peer_id)
    assert flooded > 0  # the flood was real (each identity under its own limit)
    queue = victim.validation_queue
    assert queue.peak_bytes <= queue.max_bytes and queue.peak_messages <= queue.max_messages


async def test_newcomers_connect_after_many_identities_came_and_went(make_node):
    """py-libp2p held each inbound connection's slot until the node stopped; with the slots
    scaled down from 250 to 4, ten identities that connect and are cut leave a node that
    still admits a newcomer (patches/inbound_slots.py)."""
    victim = await make_node(discovery=False)

    async def shrink() -> None:
        victim.context.host.get_network()._inbound_limiter.total_tokens = 4

    await victim.context.bridge.call(shrink)
    for _ in range(10):
        sybil = await make_node(bootstrap=victim.listen_addrs, discovery=False)
        await wait_until(lambda s=sybil: s.peer_id in victim.connected_peers(),
                         what="the sybil's connection")
        assert victim.report_misbehaviour(sybil.peer_id, 11, "bogus_batch")  # cut
        await wait_until(lambda s=sybil: s.peer_id not in victim.connected_peers(),
                         what="the cut")
        await sybil.close()
    newcomer = await make_node(discovery=False)
    await newcomer.connect(victim.listen_addrs[0])
    await wait_until(lambda: newcomer.peer_id in victim.connected_peers(), what="admission")
    assert victim.metrics["connections_refused"] == 0
