"""Floods from many identities, each under its per-origin limit, against real libp2p hosts
on 127.0.0.1 (issue 30 items 1 and 2): the honest relay that carries the flood is never cut
(nor by a peer that joins mid-flood and gets the relay's catch-up burst), honest messages
keep arriving during and after it, the work left behind is bounded, and a newcomer can
still connect once the identities came and went."""

from __future__ import annotations

import asyncio
import itertools
import time

import pytest
from swarm_node.protocol.messages import CheckpointManifest, FileEntry, ShardAdvert

from tests.waiting import async_wait_until

from .attacks import MESHSUB, signed_rpcs
from .conftest import ignore, rejects_by_sender, verdict, wait_until
from .test_gossip import rollout_batch

FLOODS = {
    # kind: (identities, messages per identity, per second each): each identity under the
    # per-peer limit (50/s verdicts and rollouts, 20/s adverts), their sum far over it
    "verdicts": (20, 80, 10.0),
    "rollouts": (20, 80, 10.0),
    "adverts": (8, 64, 8.0),
}
SETUP = {"dial_timeout_s": 10}
"""A sybil's bootstrap dial is the harness, not the claim: on a loaded CI machine the
test's one process (relay, victim, honest peer, 20 sybils) let a 3 s dial and a 5 s
bootstrap run out (a BootstrapError, CI 2026-12-03)."""
LAG_ROUNDS = 10
"""An honest message reaches the victim before the flood messages sent this many rounds
of the identities after it (1 s of the flood's designed pace; measured: 0 to 2 on a quiet
machine, -23 to 19 beside two CPU burners): a relay that lets the flood overtake it
fails, in the flood's own count, not in seconds."""
HONEST_EVERY = 2
"""The honest origin publishes once per this many rounds of the identities (rollouts: ~5/s
at the flood's pace, ~55% of its flow's fair share at the relay and the victim, 200/s over
~22 flows). One CI run (2026-12-05, beside a heavy test) lost 4 of 40 honest rollouts as
`over_budget` here: the test's one process runs all 23 nodes on one event loop, a stall of
~2 s bunched the flow's messages into the share's 1-2 s window (the test then sent at one
per 4 rounds); the fair share's burst allowance (FairShare.BURST_S) now passes such a burst
of a flow under its share (test_a_stalled_relay_never_costs_an_honest_flow_under_its_fair_share)."""
OVERTIME_S = 60
"""How long the flood may run on past its designed messages for the honest ones to arrive
while it runs: a deadline for a failure, not a pace, counted from the designed end (its
1600 messages, 8 s at its pace, took 18-20 s here on a quiet machine and 28-40 s beside
two CPU burners: the test's one process sends them). It stopped ~20-80 messages past
them."""


def _message(kind: str, origin: str, i: int):
    if kind == "verdicts":
        return verdict(i)
    if kind == "rollouts":
        return rollout_batch(origin, 200, i)
    return ShardAdvert(policy_id=origin, version=1000 + i, complete=True)  # "future" versions


async def _flood_swarm(make_node, identities: int):
    """(victim, relay, honest, sybils): the honest peer and each identity on its own
    connection to the relay (as sybil peers), the relay connected to the victim, which
    must not take the relay for the flooder."""
    victim = await make_node(discovery=False)
    relay = await make_node(bootstrap=victim.listen_addrs, discovery=False)
    honest = await make_node(bootstrap=relay.listen_addrs, discovery=False)
    sybils = [await make_node(bootstrap=relay.listen_addrs, discovery=False, **SETUP)
              for _ in range(identities)]
    return victim, relay, honest, sybils


async def _meshed(kind, victim, relay, honest, sybils, at_victim) -> dict:
    """Subscribe (the victim with `at_victim`), wait for the honest peer's path to the
    victim on `kind`, and open each sybil's raw meshsub stream to the relay (by peer id)."""
    await victim.subscribe(kind, at_victim)
    for node in (relay, honest):
        await node.subscribe(kind, ignore)
    await wait_until(lambda: honest.peer_id in relay.gossip.topic_peers(kind)
                     and relay.peer_id in victim.gossip.topic_peers(kind), 30, what="the topic")
    return {s.peer_id: await s.open_stream(relay.peer_id, MESHSUB) for s in sybils}


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(FLOODS))
async def test_a_relay_carrying_a_many_identity_flood_is_never_cut(make_node, kind):
    """Every honest message published during the flood reaches the victim (through the
    relay that carries the flood) while flood messages still reach it too: the flood goes
    on, past its designed length if need be, until the honest messages arrived and the
    victim heard more of the flood after the last one; a relay that drops, cuts or holds
    back the honest peer until the flood ends fails at the deadline, and one that queues
    it behind the flood fails the lag (LAG_ROUNDS). Measured in the flood's own progress,
    not in seconds: a loaded machine slows both alike (CI failed counting at an instant,
    the flood's end: 30 of 40 there by then, asked 32)."""
    identities, per_identity, rate = FLOODS[kind]
    victim, relay, honest, sybils = await _flood_swarm(make_node, identities)
    flood_at_victim = 0
    honest_at_victim: dict[int, int] = {}  # honest message -> flood messages heard before it
    honest_sent_after: dict[int, int] = {}  # honest message -> flood messages sent before it

    async def at_victim(env, origin):
        nonlocal flood_at_victim
        if origin == honest.peer_id:
            honest_at_victim[_index(kind, env.message)] = flood_at_victim
        else:
            flood_at_victim += 1

    streams = await _meshed(kind, victim, relay, honest, sybils, at_victim)
    loop = asyncio.get_running_loop()
    designed = identities * per_identity
    during: list[int] = []  # the honest messages published during the flood
    joiner = None
    heard_after = None  # flood messages the victim had heard when the last honest one came
    start = loop.time()
    designed_end = None  # when the designed messages were all sent
    for j in itertools.count():  # identities x rate messages/s in all, round robin
        sybil, i = sybils[j % identities], j // identities
        frame = signed_rpcs(sybil, sybil.topic(kind),
                            [sybil.identity.seal(_message(kind, sybil.peer_id, i))])[0]
        await streams[sybil.peer_id].write(frame)
        if j == designed // 3:  # a peer joins mid-flood: the relay's catch-up burst
            joiner = await make_node(bootstrap=relay.listen_addrs, discovery=False, **SETUP)
            await joiner.subscribe(kind, ignore)
        if j < designed and j % (identities * HONEST_EVERY) == 0:  # the honest origin
            during.append(10_000 + len(during))
            honest_sent_after[during[-1]] = j + 1
            await honest.publish(kind, _message(kind, honest.peer_id, during[-1]))
        if j + 1 == designed:
            designed_end = loop.time()
        if j >= designed and heard_after is None and set(during) <= honest_at_victim.keys():
            heard_after = flood_at_victim
        if heard_after is not None and flood_at_victim >= heard_after + identities:
            break  # the flood still reached the victim after the last honest message
        if designed_end is not None and loop.time() - designed_end > OVERTIME_S:
            missing = sorted(set(during) - honest_at_victim.keys())
            pytest.fail(f"after {j + 1} flood messages ({designed} designed), the victim has "
                        f"{len(during) - len(missing)} of the {len(during)} honest messages "
                        f"(missing {missing}); {flood_at_victim} flood messages reached it; "
                        f"rejects of the honest peer at the relay: "
                        f"{rejects_by_sender(relay.metrics, honest.peer_id)}, at the victim: "
                        f"{rejects_by_sender(victim.metrics, honest.peer_id)}")
        # the flood's pace (frame j leaves at j / (identities x rate) s), not a wait
        await asyncio.sleep(max(0.0, start + (j + 1) / (identities * rate) - loop.time()))
    # each honest message arrived among the flood messages sent around it, not behind them
    lag = {i: honest_at_victim[i] - honest_sent_after[i] for i in during}
    print(f"{kind}: {j + 1} flood messages sent ({designed} designed) in "
          f"{loop.time() - start:.1f} s, {flood_at_victim} reached the victim; honest "
          f"messages arrived after {min(lag.values())} to {max(lag.values())} flood messages "
          f"sent after them")
    assert max(lag.values()) <= LAG_ROUNDS * identities, lag
    # after: honest traffic is back in full, without a restart, at the honest origin's pace
    # during the flood (a burst of 10 at once, while the victim still validated the flood's
    # tail, exceeded its flow's fair share there: lost in a CI run under load)
    after = [20_000 + i for i in range(10)]
    for i in after:
        await honest.publish(kind, _message(kind, honest.peer_id, i))
        await asyncio.sleep(0.2)  # the pace, not a wait
    await wait_until(lambda: set(after) <= honest_at_victim.keys(), 30,
                     what="every honest message after the flood")
    assert relay.peer_id in victim.connected_peers()
    assert victim.penalties.cuts == 0 and relay.penalties.cuts == 0
    assert relay.peer_id not in victim.health()["refused"]
    assert joiner.penalties.cuts == 0 and relay.peer_id in joiner.connected_peers()
    assert flood_at_victim >= designed // 4  # the flood was real (each identity under its limit)
    queue = victim.validation_queue
    assert queue.peak_bytes <= queue.max_bytes and queue.peak_messages <= queue.max_messages


STALL_S = 3.0
"""How long the relay's libp2p thread is blocked in the stall test: 15 honest messages (at
~55% of their flow's fair share) and ~600 flood messages reach the relay and the victim at
once after it."""


@pytest.mark.slow
async def test_a_stalled_relay_never_costs_an_honest_flow_under_its_fair_share(make_node):
    """The fair share's burst allowance (FairShare.BURST_S): the relay carrying a
    many-identity rollout flood (200/s, its fair-share budget) stalls for STALL_S (its
    libp2p thread blocked, as a loaded machine does); the honest origin's messages, at ~55%
    of its flow's share, arrive bunched with the flood's backlog at the relay and then at the
    victim, over the share's 1-2 s window. Every one of them reaches the victim and none is
    dropped `over_budget`. Before the allowance: 16 of the 60 honest messages were lost
    (`over_budget` 11 at the relay, 5 at the victim)."""
    kind, identities, rate = "rollouts", 20, 10.0
    victim, relay, honest, sybils = await _flood_swarm(make_node, identities)
    honest_at_victim: set[int] = set()
    flood_at_victim = 0

    async def at_victim(env, origin):
        nonlocal flood_at_victim
        if origin == honest.peer_id:
            honest_at_victim.add(_index(kind, env.message))
        else:
            flood_at_victim += 1

    streams = await _meshed(kind, victim, relay, honest, sybils, at_victim)

    async def block() -> None:
        time.sleep(STALL_S)  # noqa: ASYNC251 - the stall under test: the thread blocked

    loop = asyncio.get_running_loop()
    rounds, stall_at = 120, 60  # 12 s at the flood's pace; the stall after 6 s of it
    sent: list[int] = []
    stall = None
    start = loop.time()
    for j in range(rounds * identities):
        sybil, i = sybils[j % identities], j // identities
        frame = signed_rpcs(sybil, sybil.topic(kind),
                            [sybil.identity.seal(_message(kind, sybil.peer_id, i))])[0]
        await streams[sybil.peer_id].write(frame)
        if j % identities == 0 and i % 2 == 0:  # the honest origin: 5/s, its share ~9/s
            sent.append(10_000 + i)
            await honest.publish(kind, _message(kind, honest.peer_id, sent[-1]))
        if j == stall_at * identities:
            stall = asyncio.ensure_future(relay.context.bridge.call(block))
        await asyncio.sleep(max(0.0, start + (j + 1) / (identities * rate) - loop.time()))
    await stall
    await async_wait_until(
        lambda: set(sent) <= honest_at_victim, 30, "every honest message at the victim",
        details=lambda: (f"missing {sorted(set(sent) - honest_at_victim)} of {len(sent)}; "
                         f"rejects at the relay {rejects_by_sender(relay.metrics, honest.peer_id)}"
                         f", at the victim {rejects_by_sender(victim.metrics, honest.peer_id)}"))
    assert "over_budget" not in rejects_by_sender(relay.metrics, honest.peer_id)
    assert "over_budget" not in rejects_by_sender(victim.metrics, honest.peer_id)
    assert flood_at_victim >= rounds * identities // 4  # the flood was real


def _index(kind: str, message) -> int:
    """The `i` that `_message(kind, origin, i)` made `message` from."""
    if kind == "verdicts":
        return message.policy_version
    if kind == "rollouts":
        return message.round
    return message.version - 1000


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


def _manifest(policy_id: str, version: int) -> CheckpointManifest:
    return CheckpointManifest(policy_id=policy_id, version=version, total_size=4096,
                              files=[FileEntry(name="model.safetensors", size=4096)],
                              shard_size=4096, shard_hashes=[b"\x01" * 32],
                              checkpoint_hash=b"\x02" * 32)


async def test_a_followed_trainer_stepping_fast_reaches_its_followers_whole(make_node):
    """Issue 30 item 3: manifests faster than the checkpoints rate (2/s, 20 at once) from
    the trainer a relay and its follower follow all arrive; the same pace from an origin
    they do not follow is throttled (the control)."""
    trainer = await make_node(discovery=False)
    other = await make_node(discovery=False)
    relay = await make_node(bootstrap=trainer.listen_addrs + other.listen_addrs,
                            discovery=False)
    follower = await make_node(bootstrap=relay.listen_addrs, discovery=False)
    got: dict[str, set[int]] = {trainer.peer_id: set(), other.peer_id: set()}

    async def count(env, origin):
        got[env.sender].add(env.message.version)

    for node in (relay, follower):
        node.set_followed(lambda p: p == trainer.peer_id)
    for node in (trainer, other, relay, follower):
        await node.subscribe("checkpoints", count if node is follower else ignore)
    await wait_until(lambda: follower.peer_id in relay.gossip.mesh_peers("checkpoints")
                     and relay.peer_id in trainer.gossip.mesh_peers("checkpoints")
                     and relay.peer_id in other.gossip.mesh_peers("checkpoints"), 30,
                     what="the mesh")
    n = 60  # back to back: far over the 20-manifest burst
    for v in range(n):
        await trainer.publish("checkpoints", _manifest(trainer.peer_id, v))
        await other.publish("checkpoints", _manifest(other.peer_id, v))
    await wait_until(lambda: len(got[trainer.peer_id]) == n, 30, what="every manifest")
    assert len(got[other.peer_id]) < n  # the control: the same pace, not followed
    assert relay.metrics.rejects.get((other.peer_id, "rate_limited"), 0) > 0
    assert relay.metrics.rejects.get((trainer.peer_id, "rate_limited"), 0) == 0
    assert relay.penalties.cuts == 0 and follower.penalties.cuts == 0


@pytest.mark.slow  # ~32 identities started and closed: 5-15 s
async def test_a_newcomer_connects_after_more_flooding_identities_than_a_subnet_holds(make_node):
    """Issue 30 item 2 at the p2p layer: 8 connections flooding verdicts, each a fresh
    identity under its own per-origin limit and replaced by a new one every 0.3 s, until
    twice as many identities came and went from 127.0.0.1 as one subnet may hold at once
    and as libp2p has inbound slots (both scaled down from 64 and 250 to 16, as
    test_newcomers_... does: each identity costs the test process a host start): every
    slot they took (libp2p's inbound slots, the per-subnet count) is given back, so a
    newcomer from the same subnet connects and gets its Hello answered, and the victim
    refused nobody. The same with a real trainer process and the real caps:
    tests/integration/test_trainer_dial_flood.py; figures: benchmarks/dial_flood.py."""
    import asyncio

    from swarm_node.node.testing.flood import VerdictFlood

    cap = 16  # twice the flood's live connections: a replaced carrier may linger a moment
    victim = await make_node(discovery=False)

    async def shrink() -> None:
        victim.context.host.get_network()._inbound_limiter.total_tokens = cap

    await victim.context.bridge.call(shrink)
    victim.admission.max_per_subnet = cap
    await victim.subscribe("verdicts", ignore)
    flood = VerdictFlood(victim.config, victim.listen_addrs[0], victim.peer_id,
                         connections=8, rate=20.0, churn_s=0.3)
    stop = asyncio.Event()
    flooding = asyncio.ensure_future(flood.run(stop))
    try:
        await wait_until(lambda: flood.carriers >= 2 * cap, 120,
                         what=f"{2 * cap} flooding identities")
    finally:
        stop.set()
        await flooding
    await wait_until(lambda: not victim.connected_peers(), 30, what="the flood gone")
    newcomer = await make_node(discovery=False)
    await newcomer.connect(victim.listen_addrs[0])
    await newcomer.discovery.exchange(victim.peer_id)
    assert victim.peer_id in newcomer.discovery.known  # the Hello was answered
    assert victim.metrics["connections_refused_subnet"] == 0
    assert victim.metrics["connections_refused"] == 0
    assert flood.sent > 0 and flood.cut == 0
