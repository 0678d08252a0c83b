"""The per-pubsub, per-router and process-wide pubsub patches (node/p2p/patches: push_msg,
spawn_gate, subscriptions, records, rpc_reader, validation_cache, seqno, send_queues,
flood_publish, subscription_channel): py-libp2p alone, on plain hosts and pubsubs or with
its own functions restored, still shows each problem; the patched object does not."""

from __future__ import annotations

from types import SimpleNamespace

import libp2p.pubsub.pubsub as pubsub_mod
import libp2p.pubsub.utils as pubsub_utils
import pytest
import trio
from libp2p.host.exceptions import StreamFailure
from libp2p.peer.id import ID
from libp2p.pubsub.gossipsub import PROTOCOL_ID_V11
from libp2p.pubsub.pb import rpc_pb2
from libp2p.pubsub.pubsub import Pubsub
from libp2p.pubsub.pubsub import ValidationCache as UpstreamCache
from libp2p.pubsub.rpc_queue import RpcQueue
from libp2p.utils.varint import encode_varint_prefixed
from swarm_node.node.p2p import patches
from swarm_node.node.p2p.metrics import P2PMetrics
from swarm_node.node.p2p.patches import (
    flood_publish,
    mesh_backoff,
    push_msg,
    rpc_writer,
    send_queues,
    seqno,
    spawn_gate,
    stream_retry,
    subscription_channel,
    subscriptions,
    validation_cache,
)
from swarm_node.node.p2p.patches.registry import original

from .rawhost import connect, raw_host, raw_pubsub, running, until

# (the atomic_rpc_writes test below uses real hosts: Noise + Yamux on loopback)


def _peered(pa, pb, a, b, topic: str = "t"):
    return (b.get_id() in pa.peer_topics.get(topic, ())
            and a.get_id() in pb.peer_topics.get(topic, ()))


def test_needed_push_msg_guard():
    async def main(guard: bool) -> list:
        a, b = raw_host(), raw_host()
        (ra, pa), (rb, pb) = raw_pubsub(a), raw_pubsub(b)
        faults: list = []
        seen: list = []
        if guard:
            push_msg.patch_push_msg(pa, lambda *f: faults.append(f))

        def validator(forwarder, msg) -> bool:  # a validator bug, on every other message
            seen.append(msg.data)
            if msg.data.startswith(b"bad"):
                raise RuntimeError("validator bug")
            return True

        async with running(a, b, pubsubs=[(ra, pa), (rb, pb)]):
            pa.set_topic_validator("t", validator, False)
            await pa.subscribe("t")
            await pb.subscribe("t")
            await connect(b, a)
            await until(lambda: _peered(pa, pb, a, b), what="peering")
            await pb.publish("t", b"bad 1")
            await until(lambda: faults, what="the fault")
            await pb.publish("t", b"good 2")
            await until(lambda: b"good 2" in seen, what="the next message")
        return faults

    with pytest.raises(BaseExceptionGroup) as ended:  # py-libp2p: the whole run ends
        trio.run(main, False)
    assert ended.value.subgroup(RuntimeError) is not None
    faults = trio.run(main, True)
    assert [(where, type(e)) for _, where, e in faults] == [("pubsub.push_msg", RuntimeError)]


def test_needed_skip_own_signature_check(monkeypatch):
    patches.install()
    verified = []
    upstream = original(pubsub_mod, "signature_validator")

    def counted(msg) -> bool:
        verified.append(msg.seqno)
        return upstream(msg)

    async def main(ours: bool) -> None:
        host = raw_host()
        router, pubsub = raw_pubsub(host)
        monkeypatch.setattr(pubsub_mod, "signature_validator",
                            push_msg._skip_own(counted) if ours else counted)
        if ours:
            push_msg.patch_push_msg(pubsub, lambda *f: None)
        async with running(host, pubsubs=[(router, pubsub)]):
            await pubsub.subscribe("t")
            await pubsub.publish("t", b"own message")

    trio.run(main, False)
    assert len(verified) == 1  # py-libp2p verifies the signature it has just made
    trio.run(main, True)
    assert len(verified) == 1


def test_needed_admit_before_spawn(monkeypatch):
    """py-libp2p verifies the signature of (and runs the validators on) every message a peer
    sends, however far past the router's spam limit (1/s here): the limit applies only when
    forwarding. With the gate, what `admit` refuses gets no task at all."""
    patches.install()
    verified = []
    upstream = original(pubsub_mod, "signature_validator")
    # (the publisher's checks of its own messages are skipped: only the receiver's count)
    monkeypatch.setattr(pubsub_mod, "signature_validator",
                        push_msg._skip_own(lambda msg: verified.append(1) or upstream(msg)))

    async def main(gate: bool) -> tuple[int, int]:
        a, b = raw_host(), raw_host()
        (ra, pa), (rb, pb) = raw_pubsub(a), raw_pubsub(b)
        ra.max_messages_per_topic_per_second = 1.0
        rb.max_messages_per_topic_per_second = 1000.0  # (the publisher's own limit)
        push_msg.patch_push_msg(pb, lambda *f: None)
        offered: list = []
        async with running(a, b, pubsubs=[(ra, pa), (rb, pb)]):
            if gate:
                spawn_gate.patch_spawn(pa, lambda f, m, dup: offered.append(m) or
                                       len(offered) <= 5)
            got = await pa.subscribe("t")
            await pb.subscribe("t")
            await connect(b, a)
            await until(lambda: _peered(pa, pb, a, b), what="peering")
            for i in range(30):
                await pb.publish("t", b"m%d" % i)
            await until(lambda: len(offered if gate else verified) >= 30, what="arrival")
            received = 0
            with trio.move_on_after(1):  # (a bound on the last deliveries, not a timing)
                while received < 30:
                    await got.get()
                    received += 1
            return len(verified), received

    checked, received = trio.run(main, False)
    assert checked == 30 and received == 30  # all checked and delivered: limit 1/s
    verified.clear()
    checked, received = trio.run(main, True)
    assert checked == 5 and received == 5


def test_needed_keep_subscriptions_while_connected():
    async def main(keep: bool) -> bool:
        a, b = raw_host(), raw_host()
        (ra, pa), (rb, pb) = raw_pubsub(a), raw_pubsub(b)
        if keep:
            subscriptions.patch_keep_subscriptions(pa)
        async with running(a, b, pubsubs=[(ra, pa), (rb, pb)]):
            await pa.subscribe("t")
            await pb.subscribe("t")
            await connect(b, a)
            await until(lambda: _peered(pa, pb, a, b), what="peering")
            pa._handle_dead_peer(b.get_id())  # our stream to b failed (one of two conns)
            assert pa._peer_is_connected(b.get_id())
            return b.get_id() in pa.peer_topics.get("t", ())

    assert trio.run(main, False) is False  # py-libp2p forgets b while b stays connected
    assert trio.run(main, True) is True


def test_needed_retry_pubsub_stream_failure():
    """A multistream handshake failure (StreamFailure) on the first pubsub stream open to a
    connected peer: py-libp2p gives up on the peer; patched, it retries and registers it."""
    async def main(retry: bool) -> bool:
        a, b = raw_host(), raw_host()
        (ra, pa), (rb, pb) = raw_pubsub(a), raw_pubsub(b)
        if retry:
            stream_retry.patch_stream_retry(pa)
        opened = a.new_stream
        failed = trio.Event()

        async def new_stream(peer_id, protocols, *args, **kw):
            if not failed.is_set() and any("meshsub" in str(p) for p in protocols):
                failed.set()  # what a handshake write failure on a settling connection raises
                raise StreamFailure(f"failed to open a stream to peer {peer_id}")
            return await opened(peer_id, protocols, *args, **kw)

        a.new_stream = new_stream
        async with running(a, b, pubsubs=[(ra, pa), (rb, pb)]):
            await connect(a, b)
            await failed.wait()
            with trio.move_on_after(4):  # the retry's first backoff is 0.5 s
                await until(lambda: b.get_id() in pa.peers, timeout=60, what="registration")
            assert pa._peer_is_connected(b.get_id())  # connected all along
            return b.get_id() in pa.peers

    assert trio.run(main, False) is False  # never registered: no gossip to b, ever
    assert trio.run(main, True) is True


class _HeldStream:
    """A pubsub stream whose first write (the hello) waits for `release`."""

    def __init__(self, inner, writing: trio.Event, release: trio.Event):
        self._inner, self._writing, self._release = inner, writing, release

    def __getattr__(self, name):
        return getattr(self._inner, name)

    async def write(self, data) -> None:
        if not self._writing.is_set():
            self._writing.set()
            await self._release.wait()
        await self._inner.write(data)


def test_needed_announce_subscriptions_made_during_setup():
    async def main(announce: bool) -> bool:
        a, b = raw_host(), raw_host()
        (ra, pa), (rb, pb) = raw_pubsub(a), raw_pubsub(b)
        if announce:
            subscriptions.patch_announce_during_setup(pa)
        writing, release = trio.Event(), trio.Event()
        new_stream = a.new_stream

        async def held_new_stream(peer, protocols):
            return _HeldStream(await new_stream(peer, protocols), writing, release)

        a.new_stream = held_new_stream
        async with running(a, b, pubsubs=[(ra, pa), (rb, pb)]):
            await pb.subscribe("early")
            await connect(a, b)
            with trio.fail_after(15):
                await writing.wait()  # a's hello to b is being written
            await pa.subscribe("during")  # between the hello and b's registration at a
            release.set()
            await until(lambda: b.get_id() in pa.peers, what="registration")
            await pa.subscribe("after")  # a control: announced on the same stream, later
            await until(lambda: a.get_id() in pb.peer_topics.get("after", ()),
                        what="the later announcement")
            return a.get_id() in pb.peer_topics.get("during", ())

    assert trio.run(main, False) is False  # py-libp2p: b never hears of "during"
    assert trio.run(main, True) is True


def test_needed_signed_record_memo(monkeypatch):
    patches.install()
    consumed = []
    consume = pubsub_utils.consume_envelope
    monkeypatch.setattr(pubsub_utils, "consume_envelope",
                        lambda *a: consumed.append(1) or consume(*a))

    async def main() -> tuple[int, int]:
        a, b = raw_host(), raw_host()
        async with running(a, b):
            record, _ = original(pubsub_mod, "env_to_send_in_RPC")(b)
            rpc = rpc_pb2.RPC(senderRecord=record)
            upstream = original(pubsub_mod, "maybe_consume_signed_record")
            assert upstream(rpc, a, b.get_id()) and upstream(rpc, a, b.get_id())
            n_upstream = len(consumed)
            consumed.clear()
            memo = pubsub_mod.maybe_consume_signed_record
            assert memo(rpc, a, b.get_id()) and memo(rpc, a, b.get_id())
            return n_upstream, len(consumed)

    upstream, ours = trio.run(main)
    assert upstream == 2  # py-libp2p verifies the same record on every RPC
    assert ours == 1


class _Chunked:
    def __init__(self, data: bytes, step: int = 1 << 20):
        self.data, self.step, self.reads = data, step, 0

    async def read(self, n: int) -> bytes:
        self.reads += 1
        out, self.data = self.data[:min(n, self.step)], self.data[min(n, self.step):]
        return out


def test_needed_buffered_rpc_reader():
    patches.install()
    rpcs = [b"r%03d" % i * 25 for i in range(10)]
    wire = b"".join(encode_varint_prefixed(r) for r in rpcs)

    async def main(read) -> int:
        stream = _Chunked(wire)
        assert [await read(stream, 1 << 20) for _ in rpcs] == rpcs
        return stream.reads

    assert trio.run(main, original(pubsub_mod, "read_varint_prefixed_bytes_limited")) >= 20
    assert trio.run(main, pubsub_mod.read_varint_prefixed_bytes_limited) == 1


class _Id(bytes):
    """A message id that counts the comparisons made against it."""

    compared = 0

    def __eq__(self, other) -> bool:
        _Id.compared += 1
        return bytes.__eq__(self, other)

    __hash__ = bytes.__hash__


def test_needed_o1_validation_cache():
    ids = [_Id(i.to_bytes(4, "big")) for i in range(400)]
    result = pubsub_mod.ValidationResult(is_valid=True, timestamp=1e12)
    for cache in (UpstreamCache(ttl=60, max_size=4096), validation_cache.ValidationCache(60,
                                                                                      4096)):
        for msg_id in ids:
            cache.put(msg_id, result)
        _Id.compared = 0
        assert cache.get(ids[-1]) is result
        if isinstance(cache, UpstreamCache):
            assert _Id.compared >= 400  # py-libp2p scans its LRU list on a hit
        else:
            assert _Id.compared <= 1


def test_needed_seqno_from_nanoseconds():
    host = raw_host()
    first = raw_pubsub(host)[1]
    sent = {first._next_seqno() for _ in range(5)}
    restarted = raw_pubsub(host)[1]  # the same key, restarted at once
    assert restarted._next_seqno() in sent  # py-libp2p repeats a seqno: a "duplicate"
    again = raw_pubsub(host)[1]
    seqno.patch_seqno(again)
    assert again._next_seqno() not in sent


def _rpc(size: int) -> rpc_pb2.RPC:
    return rpc_pb2.RPC(publish=[rpc_pb2.Message(data=b"x" * size, topicIDs=["t"])])


def test_needed_bounded_send_queues():
    upstream = RpcQueue()
    assert all(upstream.push(_rpc(1 << 20)) for _ in range(32))  # 32 MiB queued for one peer
    assert not upstream.push(_rpc(10))  # and the 33rd dropped without a count
    metrics = P2PMetrics()
    queues = send_queues.TunedQueues(64, 1 << 21, {}, metrics, max_bytes=4 << 20)
    queues["peer"] = RpcQueue()
    pushed = [queues["peer"].push(_rpc(1 << 20)) for _ in range(6)]
    assert pushed == [True] * 3 + [False] * 3 and metrics["drop_outbound_queue_full"] == 3


class _Sender:
    """Enough of a Pubsub for `handle_sending_messages`."""

    handle_sending_messages = None  # replaced by the patch

    def __init__(self):
        self.writes: list[int] = []

    async def write_msg(self, stream, rpc) -> bool:
        self.writes.append(len(rpc.publish))
        return True

    def _handle_dead_peer(self, peer_id) -> None:
        raise AssertionError("no error expected")


def test_needed_coalesced_sends():
    async def main(ours: bool) -> list[int]:
        sender = _Sender()
        queue = RpcQueue()
        for _ in range(5):
            queue.push(_rpc(100))
        queue.close()
        if ours:
            send_queues.patch_coalesced_sends(sender, P2PMetrics())
            await sender.handle_sending_messages("peer", None, queue)
        else:
            await original(Pubsub, "handle_sending_messages")(sender, "peer", None, queue)
        return sender.writes

    assert trio.run(main, False) == [1] * 5  # py-libp2p: one write per queued RPC
    assert trio.run(main, True) == [5]


def test_needed_flood_publish():
    def router_with(peers: list[ID]):
        router, _ = raw_pubsub(raw_host(), degree=2)
        router.pubsub = SimpleNamespace(peer_topics={"t": set(peers)})
        router.peer_protocol = dict.fromkeys(peers, PROTOCOL_ID_V11)
        router.mesh["t"] = set(peers[:2])
        return router

    me = ID(b"\x00\x01me")
    peers = [ID(b"\x00\x01p%d" % i) for i in range(6)]
    router = router_with(peers)
    assert set(router._get_peers_to_send(["t"], me, me)) == set(peers[:2])  # mesh only
    flood_publish.patch_flood_publish(router, me)
    assert set(router._get_peers_to_send(["t"], me, me)) == set(peers)
    forwarded = set(router._get_peers_to_send(["t"], peers[0], peers[5]))
    assert forwarded == {peers[1]}  # forwarded messages still go to the mesh only


def test_needed_heartbeat_prune_backoff():
    def pruned_then_regrafted(patched: bool) -> tuple[set, set]:
        router, _ = raw_pubsub(raw_host(), degree=2)  # D_low 1, D_high 3
        peers = [ID(b"\x00\x01p%d" % i) for i in range(6)]
        router.pubsub = SimpleNamespace(peer_topics={"t": set(peers)})
        router.peer_protocol = dict.fromkeys(peers, PROTOCOL_ID_V11)
        router.mesh["t"] = set(peers)  # above D_high: pruned to D
        if patched:
            mesh_backoff.patch_heartbeat_prune_backoff(router)
        _, to_prune = router.mesh_heartbeat()
        pruned = set(to_prune)
        router.mesh["t"] = set()  # the kept ones left: below D_low, graft again
        grafted, _ = router.mesh_heartbeat()
        return pruned, set(grafted)

    # upstream: the peers just pruned are candidates again (while they back us off for 60 s);
    # 4 of the 6 candidates were just pruned, so 20 tries pick one (all miss: 1 in 15^20)
    regrafts = [pruned_then_regrafted(False) for _ in range(20)]
    assert all(len(p) == 4 and len(g) == 2 for p, g in regrafts)
    assert any(g & p for p, g in regrafts)
    for _ in range(20):
        pruned, grafted = pruned_then_regrafted(True)
        assert len(pruned) == 4 and grafted and not grafted & pruned


def test_needed_ihave_to_backed_off_peers():
    """A node that pruned its extra mesh peers (backed off on both sides for a minute) still
    sends them IHAVE for the messages it holds: they may have no other way to get them."""
    def gossiped_to(patched: bool) -> set:
        router, _ = raw_pubsub(raw_host(), degree=2)
        peers = [ID(b"\x00\x01p%d" % i) for i in range(4)]
        router.pubsub = SimpleNamespace(peer_topics={"t": set(peers)})
        router.peer_protocol = dict.fromkeys(peers, PROTOCOL_ID_V11)
        router.mesh["t"] = set(peers[:2])
        for peer in peers[2:]:  # pruned by us: both sides back off (mesh_backoff above)
            router._add_back_off(peer, "t", False)
        router.mcache.put(rpc_pb2.Message(from_id=b"o", seqno=b"\x01", data=b"x",
                                          topicIDs=["t"]))
        if patched:
            mesh_backoff.patch_ihave_to_backed_off(router)
        gossip = {p for p, topics in router.gossip_heartbeat().items() if "t" in topics}
        router.mesh["t"] = set()  # below D_low: the heartbeat grafts, never a backed-off peer
        grafted, _ = router.mesh_heartbeat()
        assert set(grafted) == set(peers[:2])
        return gossip

    peers = [ID(b"\x00\x01p%d" % i) for i in range(4)]
    assert gossiped_to(False) == set()  # upstream: no IHAVE over a pruned link
    assert gossiped_to(True) == set(peers[2:])  # the non-mesh peers, backed off or not


def test_needed_counted_subscription_channel():
    async def main() -> tuple[int, int]:
        send, recv = trio.open_memory_channel(1)
        pubsub = SimpleNamespace(topic_ids={"t"}, subscribed_topics_send={"t": send})
        msg = rpc_pb2.Message(data=b"x", topicIDs=["t"])
        for _ in range(3):
            original(Pubsub, "notify_subscriptions")(pubsub, msg)  # no error, no count
        drops = []
        subscription_channel.patch_subscription_channel(pubsub, "t", 1,
                                                         lambda: drops.append(1))
        for _ in range(3):
            original(Pubsub, "notify_subscriptions")(pubsub, msg)
        return recv.statistics().current_buffer_used, len(drops)

    held, drops = trio.run(main)
    assert held == 1 and drops == 2  # py-libp2p lost 2 silently; ours counts them


def test_needed_atomic_rpc_writes():
    """Two pubsub writers on one real yamux stream (the sending loop and the router's flush
    of a new peer's pending messages): py-libp2p's write_msg interleaves the frames of
    RPCs larger than a frame, and the receiver cannot parse them."""
    patches.install()
    # larger than a frame (the patched yamux's ~1.06 MiB) whatever the send window
    rpcs = [rpc_pb2.RPC(publish=[rpc_pb2.Message(data=bytes([i]) * 1_500_000,
                                                 topicIDs=["t"])]) for i in range(4)]

    async def main(write_msg) -> list[bytes | None]:
        a, b = raw_host(), raw_host()
        got: list[bytes | None] = []
        done = trio.Event()

        async def sink(stream) -> None:
            while len(got) < len(rpcs):
                body = await pubsub_mod.read_varint_prefixed_bytes_limited(stream, 1 << 22)
                rpc = rpc_pb2.RPC()
                try:
                    rpc.ParseFromString(body)
                    got.append(rpc.publish[0].data[:1] if len(rpc.publish) == 1 else None)
                except Exception:  # noqa: BLE001 - the DecodeError the churn joiner saw
                    got.append(None)
            done.set()

        async with running(a, b):
            a.set_stream_handler("/sink/1", sink)
            await connect(b, a)
            stream = await b.new_stream(a.get_id(), ["/sink/1"])
            fake = SimpleNamespace(_handle_dead_peer=lambda peer: None)
            async with trio.open_nursery() as nursery:
                for rpc in rpcs:  # concurrent writers on one stream
                    nursery.start_soon(write_msg, fake, stream, rpc)
            with trio.move_on_after(20):
                await done.wait()
        return got

    garbled = trio.run(main, original(Pubsub, "write_msg"))
    assert sorted(x for x in garbled if x is not None) != [bytes([i]) for i in range(4)]
    assert sorted(trio.run(main, rpc_writer.write_msg)) == [bytes([i]) for i in range(4)]
