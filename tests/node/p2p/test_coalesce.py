"""Queued gossip RPCs to one peer leave as one write: what may be merged, and a burst between
two real hosts arriving whole from merged RPCs."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import trio
from libp2p.pubsub.pb import rpc_pb2
from libp2p.pubsub.rpc_queue import RpcQueue
from swarm_node.node.config import P2PSection
from swarm_node.node.p2p.errors import PublishError
from swarm_node.node.p2p.gossip import max_queued_bytes, max_rpc_size
from swarm_node.node.p2p.metrics import P2PMetrics
from swarm_node.node.p2p.patches.send_queues import (
    MERGED_RPC_MAX,
    TunedQueues,
    merge_queued_publishes,
)
from swarm_node.node.p2p.pubsub import GossipService
from trio.testing import MockClock, wait_all_tasks_blocked

from .conftest import verdict, wait_until

RECORD = b"r" * 300  # stands in for the signed peer record py-libp2p attaches to every RPC


def publish_rpc(i: int, size: int = 100, record: bytes = RECORD) -> rpc_pb2.RPC:
    msg = rpc_pb2.Message(from_id=b"origin", seqno=i.to_bytes(8, "big"), data=b"x" * size,
                          topicIDs=["t"])
    return rpc_pb2.RPC(publish=[msg], senderRecord=record)


def graft_rpc() -> rpc_pb2.RPC:
    rpc = rpc_pb2.RPC(senderRecord=RECORD)
    rpc.control.graft.append(rpc_pb2.ControlGraft(topicID="t"))
    return rpc


def seqnos(rpc: rpc_pb2.RPC) -> list[int]:
    return [int.from_bytes(m.seqno, "big") for m in rpc.publish]


def queue_of(*rpcs: rpc_pb2.RPC, priority: tuple[rpc_pb2.RPC, ...] = ()) -> RpcQueue:
    queue = RpcQueue(max_size=64)
    for rpc in rpcs:
        assert queue.push(rpc)
    for rpc in priority:
        assert queue.push(rpc, priority=True)
    return queue


def test_publish_only_rpcs_merge_in_order_within_the_size_limit():
    head = publish_rpc(0)
    queue = queue_of(*(publish_rpc(i) for i in range(1, 6)))
    merged = merge_queued_publishes(head, queue._queue, max_size=10_000)
    assert merged == 5 and seqnos(head) == [0, 1, 2, 3, 4, 5] and len(queue) == 0
    assert head.senderRecord == RECORD
    # what the merged RPC costs on the wire: one record, not six
    assert head.ByteSize() < 6 * publish_rpc(0).ByteSize() - 4 * len(RECORD)

    head = publish_rpc(0, size=1000)
    queue = queue_of(*(publish_rpc(i, size=1000) for i in range(1, 6)))
    one = publish_rpc(0, size=1000).ByteSize()
    merged = merge_queued_publishes(head, queue._queue, max_size=3 * one)
    assert head.ByteSize() <= 3 * one and merged >= 2 and len(queue) == 5 - merged
    assert seqnos(head) == list(range(merged + 1))


def test_nothing_merges_across_control_subscriptions_or_another_record():
    for blocker in (graft_rpc(),
                    rpc_pb2.RPC(subscriptions=[rpc_pb2.RPC.SubOpts(subscribe=True,
                                                                  topicid="t")]),
                    publish_rpc(9, record=b"another record")):
        head = publish_rpc(0)
        queue = queue_of(publish_rpc(1), blocker, publish_rpc(2))
        assert merge_queued_publishes(head, queue._queue, max_size=10_000) == 1
        assert seqnos(head) == [0, 1] and len(queue) == 2  # the blocker and what follows

    # a control RPC waiting with priority goes out next: nothing is merged past it
    head = publish_rpc(0)
    queue = queue_of(publish_rpc(1), priority=(graft_rpc(),))
    assert merge_queued_publishes(head, queue._queue, max_size=10_000) == 0
    assert len(queue) == 2


def test_a_peer_queue_is_bounded_in_bytes_and_merging_releases_them():
    """A flood of 256 KiB inline messages (accepted from any peer) towards a peer that does
    not read: the queue stops at max_queued_bytes (64 MiB by default), not at its 2,048
    slots (~0.5 GiB); messages of our own inline size still fill every slot."""
    cfg, metrics = P2PSection(), P2PMetrics()
    queues = TunedQueues(cfg.outbound_queue, max_rpc_size(cfg), {}, metrics,
                         max_queued_bytes(cfg))
    queues["slow"] = RpcQueue()  # as py-libp2p registers a peer
    queue = queues["slow"]
    big = publish_rpc(0, size=256 * 1024)  # one object, queued again and again
    accepted = sum(queue.push(big) for _ in range(cfg.outbound_queue))
    assert 0 < accepted < cfg.outbound_queue
    assert queue._queue.bytes == accepted * big.ByteSize() <= max_queued_bytes(cfg)
    assert metrics["drop_outbound_queue_full"] == cfg.outbound_queue - accepted
    while queue._queue.pop() is not None:  # the sending loop takes them: the bytes are freed
        pass
    assert queue._queue.bytes == 0

    # honest traffic (our inline size, distinct RPCs as py-libp2p queues them): slots first
    inline = [publish_rpc(i, size=cfg.inline_payload_max) for i in range(cfg.outbound_queue)]
    assert all(queue.push(rpc) for rpc in inline)
    assert not queue.push(publish_rpc(-1 % 2**32, size=cfg.inline_payload_max))
    head = queue._queue.pop()  # the sending loop's merge releases what it takes, too
    merged = merge_queued_publishes(head, queue._queue, MERGED_RPC_MAX)
    assert merged > 0
    assert queue._queue.bytes == (cfg.outbound_queue - 1 - merged) * inline[-1].ByteSize()


async def test_a_burst_between_two_hosts_arrives_whole_from_merged_rpcs(make_node):
    a = await make_node(discovery=False)
    b = await make_node(bootstrap=a.listen_addrs, discovery=False)
    got = []

    async def on_msg(env, peer):
        got.append(env.message.policy_version)

    await a.subscribe("verdicts", on_msg)
    await b.subscribe("verdicts", on_msg)
    await wait_until(lambda: b.peer_id in a.gossip.topic_peers("verdicts"), 20,
                     what="a to see b's subscription")
    n = 300
    # concurrent publishes queue up in a's outbound queue to b faster than it writes them
    await asyncio.gather(*(a.publish("verdicts", verdict(i)) for i in range(n)))
    await wait_until(lambda: len(got) >= n, 30, what="every message at b")
    assert sorted(got) == list(range(n))
    sent = a.metrics.snapshot()["counters"]
    assert sent.get("gossip_rpcs_merged", 0) > 0  # the burst did travel in merged RPCs
    assert b.metrics.snapshot()["counters"].get("rejected", 0) == 0


def publisher(cfg: P2PSection) -> tuple[P2PMetrics, TunedQueues, GossipService]:
    """A gossip service over tuned peer queues alone (no host): what publish waits on."""
    metrics = P2PMetrics()
    queues = TunedQueues(64, 1 << 20, {}, metrics)
    ctx = SimpleNamespace(cfg=cfg, metrics=metrics, bridge=None,
                          pubsub=SimpleNamespace(peer_queues=queues))
    return metrics, queues, GossipService(ctx, validator=None, requests=None, bulk=None,
                                          report=print)


def test_a_publish_over_the_high_water_waits_for_the_queues_not_a_timer():
    """A publish finds a peer queue over `publish_high_water`: it goes on as soon as RPCs
    leave that queue (or the queue goes away), woken by the queue itself, and raises
    queue_full once `publish_timeout_s` passed without that (the clock is trio's mock: no
    time passes unless the test moves it; the stall rule, below, is out of reach here)."""
    cfg = P2PSection(publish_high_water=2, publish_timeout_s=5.0, publish_stall_s=50.0)
    metrics, queues, gossip = publisher(cfg)
    clock = MockClock()

    async def main() -> list:
        outcomes: list = []

        async def publish() -> None:
            try:
                await gossip._t_wait_capacity()
                outcomes.append("sent")
            except PublishError as e:
                outcomes.append(e.reason)

        for peer in ("slow", "gone"):
            queues[peer] = RpcQueue()
            for i in range(4):
                queues[peer].push(publish_rpc(i))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(publish)
            await wait_all_tasks_blocked()
            await queues["slow"].pop()
            del queues["gone"]
            await wait_all_tasks_blocked()
            assert outcomes == []  # "slow" still holds 3
            await queues["slow"].pop()  # 2: at the high water
            await wait_all_tasks_blocked()
            assert outcomes == ["sent"]
            queues["slow"].push(publish_rpc(9))
            nursery.start_soon(publish)
            await wait_all_tasks_blocked()
            clock.jump(4.9)
            await wait_all_tasks_blocked()
            assert outcomes == ["sent"]  # still waiting
            clock.jump(0.2)
        return outcomes

    assert trio.run(main, clock=clock) == ["sent", "queue_full"]
    assert metrics["publish_waits"] == 2


def test_a_queue_that_stopped_moving_does_not_hold_the_publishes():
    """A peer behind a partition (or a dead path the liveness check has not closed yet)
    takes nothing from its queue: a publish waits for it `publish_stall_s` at most, the
    queue is then marked stalled and no later publish waits for it, while a slow peer that
    does move still holds them; once an RPC leaves the stalled queue, it is waited for
    again. Before: every publish of the node waited `publish_timeout_s` (60 s) and raised
    queue_full, or until the liveness check closed the connection (the wan benchmark's
    trainer held a checkpoint 43 s across a partition's heal). Trio's mock clock."""
    cfg = P2PSection(publish_high_water=2)  # publish_stall_s 5, publish_timeout_s 60
    metrics, queues, gossip = publisher(cfg)
    clock = MockClock()

    async def main() -> list:
        outcomes: list = []

        async def publish(name: str) -> None:
            try:
                await gossip._t_wait_capacity()
                outcomes.append((name, "sent", trio.current_time()))
            except PublishError as e:
                outcomes.append((name, e.reason, trio.current_time()))

        for peer in ("dead", "slow"):
            queues[peer] = RpcQueue()
            for i in range(6):
                queues[peer].push(publish_rpc(i))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(publish, "first")
            await wait_all_tasks_blocked()
            clock.jump(3.0)
            await queues["slow"].pop()  # "slow" moves: 5 left, still over the water
            await wait_all_tasks_blocked()
            clock.jump(2.0)  # "dead": nothing left it for 5 s
            await wait_all_tasks_blocked()
            assert outcomes == []  # "slow" still holds 5, and it moves: waited for
            for _ in range(3):
                await queues["slow"].pop()
            await wait_all_tasks_blocked()
            assert outcomes == [("first", "sent", 5.0)]
            assert queues["dead"]._queue.stalled and not queues["slow"]._queue.stalled
            # the next publish does not wait for the stalled queue at all
            waits = metrics["publish_waits"]
            nursery.start_soon(publish, "second")
            await wait_all_tasks_blocked()
            assert outcomes[-1] == ("second", "sent", 5.0) and metrics["publish_waits"] == waits
            # the path is back: an RPC leaves "dead", which is waited for again
            await queues["dead"].pop()
            assert not queues["dead"]._queue.stalled
            nursery.start_soon(publish, "third")
            await wait_all_tasks_blocked()
            assert outcomes[-1][0] == "second"
            for _ in range(3):
                await queues["dead"].pop()
            await wait_all_tasks_blocked()
            assert outcomes[-1] == ("third", "sent", 5.0)
        return outcomes

    trio.run(main, clock=clock)
    assert metrics["publish_stalled_queues"] == 1
