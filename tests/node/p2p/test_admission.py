"""Gossip admission as units with a controlled clock (admission.py): who is charged, the
fair shares under a many-identity flood, the bounded validation queue. The same code on
real hosts: test_sybil_floods.py."""

from __future__ import annotations

import trio
from libp2p.peer.id import ID
from libp2p.pubsub.pb import rpc_pb2
from swarm_node.node.identity import Identity
from swarm_node.node.p2p.admission import (
    DROP_WARN_AT,
    NEW_ORIGINS_BURST,
    Admission,
    FairShare,
    ValidationQueue,
)
from swarm_node.node.p2p.metrics import P2PMetrics
from swarm_node.node.p2p.penalties import PeerPenalties
from swarm_node.protocol.limits import TopicRate

TOPIC = "/swarm-node/default/verdicts/1"


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def peer() -> ID:
    return ID.from_base58(Identity.generate().peer_id)


def msg(origin: ID, data: bytes = b"x") -> rpc_pb2.Message:
    return rpc_pb2.Message(from_id=origin.to_bytes(), data=data, topicIDs=[TOPIC])


def admission(clock, **kw):
    cuts: list[str] = []
    pen = PeerPenalties(cuts.append, clock=clock)
    adm = Admission(pen, P2PMetrics(), clock=clock, **kw)
    return adm, pen, cuts


def test_a_relay_is_never_charged_for_what_it_relays():
    clock = Clock()
    adm, pen, cuts = admission(clock, rates={"verdicts": TopicRate(per_s=5, burst=5)})
    relay, origins = peer(), [peer() for _ in range(20)]
    for _ in range(50):  # 20 origins x 50 messages, each origin far over its rate
        for o in origins:
            if adm.admit(relay, msg(o), False):
                adm.accept(o.to_base58(), "verdicts")
    assert pen.score(relay.to_base58()) == 0 and not cuts
    assert adm.metrics["rejected.rate_limited"] > 0
    # ... and an origin that sends its own messages too fast is dropped, never cut: an
    # honest trainer's bursts must not get it cut by its followers
    flooder = peer()
    admitted = [adm.admit(flooder, msg(flooder), False) for _ in range(200)]
    assert admitted.count(True) == 5 and not cuts and pen.score(flooder.to_base58()) == 0
    assert adm.metrics.rejects[(flooder.to_base58(), "rate_limited")] == 195


def test_the_per_origin_rate_is_counted_against_the_proven_origin():
    clock = Clock()
    adm, pen, _ = admission(clock, rates={"verdicts": TopicRate(per_s=1, burst=3)})
    origin = Identity.generate().peer_id
    assert [adm.accept(origin, "verdicts") for _ in range(5)] == [True] * 3 + [False] * 2
    assert adm.metrics.rejects[(origin, "rate_limited")] == 2 and pen.score(origin) == 0
    clock.t += 2
    assert adm.accept(origin, "verdicts")


def test_a_forged_origin_only_drains_the_forgers_own_bucket():
    clock = Clock()
    adm, _, _ = admission(clock, rates={"verdicts": TopicRate(per_s=1, burst=2)})
    honest, forger, relay = peer(), peer(), peer()
    adm.accept(honest.to_base58(), "verdicts")  # known
    assert [adm.admit(forger, msg(honest), False) for _ in range(4)] == [True] * 2 + [False] * 2
    assert adm.admit(relay, msg(honest), False)  # the honest path is untouched


def test_new_origins_are_throttled_per_connection_and_reports_cost_the_introducer():
    clock = Clock()
    adm, pen, cuts = admission(clock)
    carrier, relay = peer(), peer()
    fresh = [peer() for _ in range(int(NEW_ORIGINS_BURST) + 10)]
    admitted = [adm.admit(carrier, msg(o), False) for o in fresh]
    assert admitted.count(True) == NEW_ORIGINS_BURST  # then throttled, not cut
    assert adm.metrics["rejected.new_origin_throttled"] == 10 and not cuts
    known = fresh[0].to_base58()
    adm.accept(known, "verdicts")
    assert adm.admit(carrier, msg(fresh[0]), False)  # known origins still pass through it
    clock.t += 10  # 20 tokens back ...
    for o in fresh[1:6]:  # ... 5 of its origins reported: 20 tokens charged
        assert adm.reported(o.to_base58()) == carrier.to_base58()
    assert not adm.admit(carrier, msg(peer()), False)
    assert adm.admit(relay, msg(peer()), False)  # another connection is not affected
    assert pen.score(carrier.to_base58()) == 0


def test_fair_share_bounds_a_flood_and_lets_light_flows_through():
    clock = Clock()
    fair = FairShare(100.0, clock=clock)
    admitted = {k: 0 for k in range(21)}  # 20 flood flows at 100/s, one light flow at 2/s
    for step in range(1000):  # 10 s in steps of 10 ms
        clock.t += 0.01
        for k in range(20):
            admitted[k] += fair.allow(k)
        if step % 50 == 0:
            admitted[20] += fair.allow(20)
    assert admitted[20] == 20  # the light flow (below the fair share 100/21): every message
    total = sum(admitted.values())
    assert total <= 100 * 10 * 1.25  # the flood is held near the budget (not 20,000)
    assert max(admitted[k] for k in range(20)) <= 3 * min(admitted[k] for k in range(20))


def test_established_origins_skip_the_fair_share():
    clock = Clock()
    adm, _, _ = admission(clock, global_rates={"verdicts": 10.0})
    known = peer()
    adm.set_established(lambda p: p == known.to_base58())
    relay, flood = peer(), [peer() for _ in range(20)]
    for o in flood + [known]:
        adm.accept(o.to_base58(), "verdicts")
    passed = 0
    for _ in range(30):
        clock.t += 0.01
        for o in flood:
            adm.admit(relay, msg(o), False)
        passed += adm.admit(relay, msg(known), False)
    assert passed == 30 and adm.metrics["rejected.over_budget"] > 0


def test_a_followed_trainer_is_never_throttled_by_its_own_publication_rate():
    """Issue 30 item 3: a trainer stepping faster than the checkpoints rate (2/s) reaches
    its followers whole; another origin at the same pace is throttled; forged copies of the
    trainer's messages on one connection stay bounded."""
    clock = Clock()
    adm, pen, cuts = admission(clock, global_rates={"checkpoints": 1.0})
    trainer, other, relay, forger = peer(), peer(), peer(), peer()
    adm.set_followed(lambda p: p == trainer.to_base58())
    passed = {trainer: 0, other: 0}
    for _ in range(300):  # 10 manifests/s each for 30 s, through one relay
        clock.t += 0.1
        for origin in passed:
            m = msg(origin)
            m.topicIDs[:] = ["/swarm-node/default/checkpoints/1"]
            passed[origin] += (adm.admit(relay, m, False)
                               and adm.accept(origin.to_base58(), "checkpoints"))
    assert passed[trainer] == 300
    assert passed[other] <= 20 + 2 * 30 + 1  # burst + rate: throttled, never cut
    assert not cuts and pen.score(relay.to_base58()) == 0
    m = msg(trainer)
    m.topicIDs[:] = ["/swarm-node/default/checkpoints/1"]
    forged = sum(adm.admit(forger, m, False) for _ in range(1000))  # at once, one connection
    assert forged == 200  # the (connection, origin) bucket: 10x the topic's burst


def test_the_validation_queue_serves_flows_in_turn_and_drops_from_the_longest():
    clock = Clock()
    adm, _, _ = admission(clock)
    queue = ValidationQueue(adm, max_messages=40, flow_messages=30)
    flooder, honest = peer(), peer()
    for _ in range(35):
        queue.put(flooder, msg(flooder))
    assert len(queue) == 30  # its flow is full: the rest dropped
    for _ in range(12):
        assert queue.put(honest, msg(honest))  # evicts the flooder's newest, not these
    assert len(queue) == 40 and queue.metrics["gossip_queue_dropped"] == 7

    async def drain() -> list[str]:
        return [(await queue.get())[0].to_base58()[-4:] for _ in range(6)]

    order = trio.run(drain)
    assert order == [flooder.to_base58()[-4:], honest.to_base58()[-4:]] * 3  # in turn
    assert queue.peak_messages == 40


def test_many_identities_behind_one_subnet_get_that_subnets_share():
    clock = Clock()
    adm, _, _ = admission(clock, global_rates={"verdicts": 100.0})
    flood = [peer() for _ in range(20)]
    honest = [peer() for _ in range(3)]
    for i, p in enumerate(flood):
        adm.connected(p.to_base58(), f"10.0.0.{i + 1}")  # one /24
    for i, p in enumerate(honest):
        adm.connected(p.to_base58(), f"192.168.{i}.7")  # three others
    for p in flood + honest:
        adm.accept(p.to_base58(), "verdicts")
    got = {p: 0 for p in flood + honest}
    for step in range(500):  # 5 s: each flood identity at 50/s, each honest peer at 20/s
        clock.t += 0.01
        for p in flood:
            if step % 2 == 0 and adm.admit(p, msg(p), False):
                got[p] += 1
        if step % 5 == 0:
            for p in honest:
                got[p] += adm.admit(p, msg(p), False)
    assert all(got[p] >= 0.8 * 100 for p in honest)  # each honest peer keeps >= 80% ...
    # ... from the start, while the 20 identities (5,000 messages offered) get what the
    # honest peers leave of the 100/s budget (~40%), not 20/23 of it
    assert sum(got[p] for p in flood) <= 5 * 100 * 0.7


def test_a_subnet_holds_a_bounded_number_of_peers_with_a_reserve_for_known_ones():
    clock = Clock()
    adm, _, _ = admission(clock)
    adm.max_per_subnet = 3
    known = Identity.generate().peer_id
    adm.set_established(lambda p: p == known)
    peers = [Identity.generate().peer_id for _ in range(5)]
    assert [adm.connected(p, "127.0.0.1") for p in peers] == [True] * 3 + [False] * 2
    assert adm.connected(known, "127.0.0.1")  # the reserve
    assert adm.connected(peers[0], "127.0.0.1")  # a second connection of a peer in
    assert adm.connected(peers[3], "10.1.1.1")  # another subnet
    adm.disconnected(peers[1])
    assert adm.connected(peers[4], "127.0.0.1")


def test_a_fresh_key_flood_logs_one_line_per_carrier(caplog):
    clock = Clock()
    adm, _, _ = admission(clock)
    carrier = peer()
    with caplog.at_level("WARNING", logger="swarm_node.node.p2p.admission"):
        for _ in range(3):  # 3 log periods, each 100 fresh keys over the new-origin allowance
            for _ in range(100):
                adm.admit(carrier, msg(peer()), False)
            clock.t += 10
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3 and all(carrier.to_base58() in line for line in lines), lines
    assert "64+ origin(s)" in lines[-1]


def test_a_few_drops_are_no_warning(caplog):
    """A burst of messages over an allowance (a joiner's catch-up, a restart) is no flood:
    DEBUG, not the WARNING an honest operator reads as "my trainer floods"; a flood's
    WARNING comes as soon as DROP_WARN_AT drops gather."""
    clock = Clock()
    adm, _, _ = admission(clock)
    carrier = peer()

    def levels() -> list[str]:
        return [r.levelname for r in caplog.records if "dropped" in r.getMessage()]
    with caplog.at_level("DEBUG", logger="swarm_node.node.p2p.admission"):
        for _ in range(int(NEW_ORIGINS_BURST) + DROP_WARN_AT - 1):  # fresh keys, over the allowance
            adm.admit(carrier, msg(peer()), False)
        assert levels() == ["DEBUG"]  # the first drop, said quietly
        adm.admit(carrier, msg(peer()), False)  # DROP_WARN_AT - 1 since that line
        assert levels() == ["DEBUG"]
        adm.admit(carrier, msg(peer()), False)  # DROP_WARN_AT: a flood, said at once
        assert levels() == ["DEBUG", "WARNING"]


def test_our_own_messages_echoed_back_are_dropped_silently():
    """After a restart the seen-cache is empty and peers forward the previous run's
    messages back: they are ours, not a flood of new origins (no warning, no charge)."""
    clock = Clock()
    me, relay = peer(), peer()
    adm, _pen, cuts = admission(clock, self_id=me.to_base58())
    assert not any(adm.admit(relay, msg(me), False) for _ in range(100))
    assert adm.metrics["gossip_own_echoes"] == 100
    assert adm.metrics["rejected.new_origin_throttled"] == 0 and not cuts
    assert adm.admit(relay, msg(peer()), False)  # the relay's new-origin tokens are intact


def test_fair_share_lets_a_light_flow_bunched_by_a_stall_through_whole():
    """The burst allowance (FairShare.BURST_S): 20 flood flows at twice their share and a
    light flow at ~52% of it, all held back by a 3 s stall (of the relay that carries them)
    and delivered at once: every light message passes (before the allowance: 33 of 38),
    and the flood stays at its share over the whole run (the budget, 100/s)."""
    clock = Clock()
    fair = FairShare(100.0, clock=clock)
    light = sent = flood = 0
    for step in range(150):  # 15 s in rounds of 100 ms: each flood flow 10/s, the light 2.5/s
        if not 60 <= step < 90:  # rounds 60-89: the stall, delivered at the end of it
            clock.t += 0.1
        elif step == 60:
            clock.t += 3.0
        for k in range(20):
            flood += fair.allow(k)
        if step % 4 == 0:
            sent += 1
            light += fair.allow("light")
    assert light == sent == 38
    assert flood <= 100 * 15 * 1.1
    rich = FairShare(100.0, clock=clock)  # a flood flow never banks an allowance
    for _ in range(300):
        clock.t += 0.05
        for k in range(20):
            rich.allow(k)
    clock.t += 0.001
    assert sum(rich.allow(0) for _ in range(20)) <= 1
