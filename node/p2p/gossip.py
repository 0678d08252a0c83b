"""GossipSub set up so that nothing is dropped silently (trio side).

py-libp2p 0.8.1's defaults drop messages: 10 messages/s/topic/peer spam limit, 32-slot
outbound queue per peer, 1 MiB RPC cap, 32-slot subscription channel. Here: the spam limit
is raised to `p2p.max_messages_per_second`, the outbound queues and the subscription channel
are enlarged, every remaining drop is counted, and `publish` waits for queue capacity.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

import trio
from libp2p.peer.id import ID
from libp2p.pubsub.gossipsub import PROTOCOL_ID, PROTOCOL_ID_V11, GossipSub
from libp2p.pubsub.pubsub import Pubsub
from libp2p.pubsub.rpc_queue import PriorityQueue
from libp2p.utils.varint import encode_uvarint

from ...protocol.envelope import Envelope, ReplayCache, open_envelope
from ...protocol.errors import ProtocolError
from ...protocol.limits import ANNOUNCE_TYPE, TOPIC_MESSAGE_TYPES, Limits
from .metrics import P2PMetrics

log = logging.getLogger(__name__)

# Room for the pubsub framing around one envelope (from, seqno, key, signature, topic, record).
RPC_OVERHEAD = 16 * 1024


def build_gossip(host, cfg, metrics: P2PMetrics) -> tuple[GossipSub, Pubsub]:
    """GossipSub router + Pubsub for `host` from the `p2p` config section."""
    router = GossipSub(
        protocols=[PROTOCOL_ID_V11, PROTOCOL_ID],
        degree=cfg.mesh_degree,
        degree_low=cfg.mesh_degree_low,
        degree_high=cfg.mesh_degree_high,
        heartbeat_initial_delay=0.1,
        heartbeat_interval=cfg.heartbeat_interval_s,
        time_to_live=60,
        gossip_window=3,
        gossip_history=5,
        spam_protection_enabled=True,
        max_messages_per_topic_per_second=float(cfg.max_messages_per_second),
        # All peers of a loopback or single-LAN swarm share one IP; the IP-diversity rule
        # would then prune honest peers from the mesh.
        eclipse_protection_enabled=False,
    )
    pubsub = Pubsub(
        host, router,
        cache_size=4096,
        strict_signing=True,
        validation_cache_size=4096,
        max_inbound_rpc_size=max_rpc_size(cfg),
    )
    # Message ids are (from, seqno), and py-libp2p starts the seqno counter at the current
    # second. A node restarted with the same key within n seconds after publishing more than
    # n messages reused seqnos, and every peer that had seen them dropped the new messages as
    # duplicates (found by test_restart_with_same_key_rejoins). Nanoseconds, as go-libp2p does.
    pubsub.counter = seqno_start()
    pubsub.peer_queues = TunedQueues(cfg.outbound_queue, max_rpc_size(cfg), pubsub.peer_queues,
                                     metrics, max_queued_bytes(cfg))
    return router, pubsub


# Inline payloads we accept from others (the default threshold before the payload plane):
# a peer configured with a higher `inline_payload_max` is still understood.
ACCEPTED_INLINE_MAX = 256 * 1024


def flood_own_publishes(router: GossipSub, self_id: ID) -> None:
    """GossipSub v1.1 flood publishing (go-libp2p's default; py-libp2p 0.8.1 lacks it): a
    message we originate goes to every subscribed GossipSub peer, not only our mesh, so every
    directly connected subscriber gets it in one hop. Forwarded messages still go to the mesh
    only. Publishes are small (payloads above `inline_payload_max` are announced and pulled),
    so the few extra sends cost little, and the mesh degree no longer sets the first hop."""
    inner = router._get_peers_to_send

    def peers_to_send(topic_ids, msg_forwarder: ID, origin: ID, msg_id: bytes | None = None):
        peers = set(inner(topic_ids, msg_forwarder=msg_forwarder, origin=origin, msg_id=msg_id))
        if msg_forwarder == self_id and origin == self_id and router.pubsub is not None:
            for t in topic_ids:
                peers.update(p for p in router.pubsub.peer_topics.get(t, ())
                             if router.peer_protocol.get(p) in (PROTOCOL_ID, PROTOCOL_ID_V11))
            peers.discard(self_id)
        return peers

    router._get_peers_to_send = peers_to_send


@functools.lru_cache(maxsize=4096)
def origin_b58(from_id: bytes) -> str:
    """The base58 peer id of a pubsub message's `from` bytes, memoised: every received copy
    needs it (validator, reader), and `ID(...).to_base58()` re-encodes each time."""
    return ID(from_id).to_base58()


def seqno_start() -> int:
    """First pubsub seqno of this process: the clock in nanoseconds, so that a restart with
    the same key never repeats a seqno of the previous run (fits in the 8-byte field)."""
    return time.time_ns()


def max_rpc_size(cfg) -> int:
    return max(cfg.inline_payload_max, ACCEPTED_INLINE_MAX) + RPC_OVERHEAD


def max_queued_bytes(cfg) -> int:
    """Bytes one peer's outbound queue may hold: its slots full of messages of our own inline
    size (64 MiB by default). Without it, a peer forwarding 256 KiB inline messages (which we
    accept) to a peer that does not read could park outbound_queue x 272 KiB (~0.5 GiB) per
    slow peer here; honest traffic (inline <= inline_payload_max) fills the slots first."""
    return cfg.outbound_queue * (cfg.inline_payload_max + RPC_OVERHEAD)


def coalesce_publish_writes(pubsub: Pubsub, metrics: P2PMetrics) -> None:
    """Send the RPCs that queued up for a peer while its sending loop waited as one write.

    py-libp2p 0.8.1 writes each queued RPC separately: one yamux frame, one Noise message
    and one socket write per forwarded message, and at the peer one frame-loop pass, one
    stream read and one RPC parse each (~1.4 ms of Python per copy, send and receive, in
    the 8-peer benchmark). Messages arrive in bursts (every peer publishes at a round's
    start and forwards what it receives to its mesh), so the loop here yields once after
    waking, then merges the publish-only RPCs waiting behind the first one into it (an
    RPC may carry several messages; the wire format is unchanged), up to the queue's
    message-size limit. Control RPCs (priority) and RPCs with subscriptions or control
    are never merged and keep their order. Idempotent per pubsub."""
    if getattr(pubsub.handle_sending_messages, "_swarm_coalesce", False):
        return

    async def handle_sending_messages(peer_id: ID, stream, queue) -> None:
        try:
            while True:
                rpc = await queue.pop()  # (a BoundedQueue's pop releases its bytes)
                if rpc is None:
                    return  # the queue was closed
                if publish_only(rpc) and len(queue):
                    await trio.lowlevel.checkpoint()  # let this burst's forwards queue up
                    merged = merge_queued_publishes(rpc, queue._queue, MERGED_RPC_MAX)
                    if merged:
                        metrics.inc("gossip_rpcs_merged", merged)
                if not await pubsub.write_msg(stream, rpc):
                    return
        except Exception:  # as py-libp2p's loop: the peer is handled as dead
            log.debug("sending loop for %s ended with an error", peer_id, exc_info=True)
            pubsub._handle_dead_peer(peer_id)

    handle_sending_messages._swarm_coalesce = True
    pubsub.handle_sending_messages = handle_sending_messages


# A merged RPC stays within what every peer of ours accepts (`max_rpc_size` of a default
# config), whatever our own inline_payload_max.
MERGED_RPC_MAX = ACCEPTED_INLINE_MAX + RPC_OVERHEAD


def embedded_size(n: int) -> int:
    """Wire size of an n-byte bytes field of a protobuf message (tag, varint length, n);
    0 for an empty field (proto2 optional, absent)."""
    return 1 + len(encode_uvarint(n)) + n if n else 0


def publish_only(rpc) -> bool:
    """An RPC of messages only (and the sender record): safe to merge with another."""
    return bool(rpc.publish) and not rpc.subscriptions and not rpc.HasField("control")


def merge_queued_publishes(rpc, pending, max_size: int) -> int:
    """Move the publish-only RPCs at the head of `pending` (py-libp2p's PriorityQueue) into
    `rpc` while the result stays within max_size; stops at the first RPC that is not
    publish-only or does not fit, and whenever a priority (control) RPC waits, so nothing
    is reordered across a control message. Returns how many RPCs were merged."""
    merged = 0
    size = rpc.ByteSize()
    queued = pending._non_priority
    while queued and not pending._priority:
        nxt = queued[0]
        if not publish_only(nxt) or nxt.senderRecord != rpc.senderRecord:
            break
        extra = nxt.ByteSize() - embedded_size(len(nxt.senderRecord))
        if size + extra > max_size:
            break
        queued.popleft()
        if isinstance(pending, BoundedQueue):
            pending.release(nxt)
        rpc.publish.extend(nxt.publish)
        size += extra
        merged += 1
    return merged


class BoundedQueue(PriorityQueue):
    """py-libp2p's per-peer RPC queue, bounded in bytes as well as in RPCs: a push that
    would take the queued bytes over `max_bytes` is refused like one over `max_size` (an
    empty queue takes any one RPC; the RPC size limit applies before)."""

    def __init__(self, max_size: int, max_bytes: int):
        super().__init__(max_size)
        self.max_bytes = max_bytes
        self.bytes = 0

    def push(self, rpc, priority: bool = False) -> bool:
        n = rpc.ByteSize()
        if len(self) and self.bytes + n > self.max_bytes:
            return False
        if not super().push(rpc, priority):
            return False
        self.bytes += n
        return True

    def pop(self):
        rpc = super().pop()
        if rpc is not None:
            self.release(rpc)
        return rpc

    def release(self, rpc) -> None:
        """`rpc` (unchanged since its push) left the queue."""
        self.bytes = self.bytes - rpc.ByteSize() if len(self) else 0


class TunedQueues(dict):
    """Replaces Pubsub.peer_queues: each per-peer queue created by py-libp2p is resized
    (RPC slots, and bytes: BoundedQueue) as it is registered, and its rejected pushes are
    counted."""

    def __init__(self, max_size: int, max_message_size: int, initial: dict,
                 metrics: P2PMetrics, max_bytes: int | None = None):
        super().__init__(initial)
        self.metrics = metrics
        self.max_size = max_size
        self.max_message_size = max_message_size
        self.max_bytes = max_bytes if max_bytes is not None else max_size * max_message_size

    def __setitem__(self, peer_id, queue) -> None:
        bounded = BoundedQueue(self.max_size, self.max_bytes)
        for rpc in queue._queue._priority:  # normally empty when registered
            bounded.push(rpc, priority=True)
        for rpc in queue._queue._non_priority:
            bounded.push(rpc)
        queue._queue = bounded
        queue.max_message_size = self.max_message_size
        original_push = queue.push
        metrics = self.metrics

        def counted_push(rpc, priority: bool = False) -> bool:
            ok = original_push(rpc, priority)
            if not ok and len(rpc.publish):
                metrics.inc("drop_outbound_queue_full", len(rpc.publish))
            return ok

        queue.push = counted_push
        super().__setitem__(peer_id, queue)

    def fullest(self) -> tuple[object, int]:
        worst, worst_len = None, 0
        for peer, queue in list(self.items()):
            n = len(queue)
            if n > worst_len:
                worst, worst_len = peer, n
        return worst, worst_len


class CountingSendChannel:
    """Stands in for the subscription channel py-libp2p fills with `send_nowait`;
    a full channel is counted instead of only logged."""

    def __init__(self, inner: trio.MemorySendChannel, metrics: P2PMetrics):
        self.inner = inner
        self.metrics = metrics

    def send_nowait(self, msg) -> None:
        try:
            self.inner.send_nowait(msg)
        except trio.WouldBlock:
            self.metrics.inc("drop_subscription_full")
            raise

    async def aclose(self) -> None:
        await self.inner.aclose()

    def close(self) -> None:
        self.inner.close()


class SharedReplayCache(ReplayCache):
    """The replay cache both threads that open envelopes use: the topic validator (libp2p
    thread) and the pulled bodies of announced payloads (asyncio thread). ReplayCache is an
    OrderedDict swept on every check; unguarded, one thread's insert during the other's
    sweep raised "OrderedDict mutated during iteration", and the validator turned that into
    an `internal_error` rejection of an honest message, penalising its forwarder (1 batch of
    1120 lost in 2 of 7 runs of the 8-peer benchmark)."""

    def __init__(self, window_s: float):
        super().__init__(window_s=window_s)
        self._lock = threading.Lock()

    def check_and_add(self, sender: str, nonce: bytes, now: float) -> None:
        with self._lock:
            super().check_and_add(sender, nonce, now)


class GossipValidator:
    """Topic validator: the peer filter, then `open_envelope` (size, schema, signature,
    sender = pubsub origin, skew, replay), then the topic <-> type rule. Rejects are
    counted per forwarding peer and reason and reported to `on_reject(peer, reason)` (the
    penalties). Accepted envelopes are kept until delivery so they are decoded once."""

    def __init__(self, self_id: str, limits: Limits, metrics: P2PMetrics,
                 peer_filter: Callable[[], Callable[[str], bool] | None],
                 max_skew_s: float, on_reject: Callable[[str, str], object] | None = None):
        self.self_id = self_id
        self.limits = limits
        self.metrics = metrics
        self.peer_filter = peer_filter
        self.max_skew_s = max_skew_s
        self.on_reject = on_reject
        self.replay = SharedReplayCache(window_s=2 * max_skew_s)  # the whole skew window
        self.accepted: OrderedDict[bytes, Envelope] = OrderedDict()
        self.carried_by: OrderedDict[str, str] = OrderedDict()  # origin -> forwarding peer
        self.max_pending = 65536

    def for_kind(self, kind: str) -> Callable[[ID, object], bool]:
        """The validator of topic `kind`: only its message types pass."""
        allowed = TOPIC_MESSAGE_TYPES.get(kind, frozenset())
        return lambda forwarder, msg: self.validate(allowed, forwarder, msg)

    def _reject(self, fwd: str, reason: str) -> bool:
        self.metrics.reject(fwd, reason)
        if self.on_reject is not None:
            self.on_reject(fwd, reason)
        return False

    def validate(self, allowed: frozenset[str], forwarder: ID, msg) -> bool:
        fwd = forwarder.to_base58()
        try:
            origin = origin_b58(msg.from_id)
        except Exception:  # noqa: BLE001 - unparseable origin
            return self._reject(fwd, "bad_peer_id")
        if origin == self.self_id:
            return True  # our own publish, sealed by us
        allow = self.peer_filter()
        if allow is not None and (not allow(fwd) or not allow(origin)):
            self.metrics.reject(fwd, "banned")
            return False
        try:
            env = open_envelope(msg.data, limits=self.limits, expected_sender=origin,
                                replay_cache=self.replay, max_skew_s=self.max_skew_s)
        except ProtocolError as e:
            log.info("rejected gossip from %s (origin %s): %s", fwd, origin, e)
            return self._reject(fwd, e.reason)
        except Exception as e:  # noqa: BLE001 - a decoder bug must not kill the host
            log.warning("validator error on message from %s: %s: %s", fwd, type(e).__name__, e)
            return self._reject(fwd, "internal_error")
        inner = env.message.inner_type if env.type == ANNOUNCE_TYPE else env.type
        if inner not in allowed:
            log.info("rejected a %s envelope from %s (origin %s) on a topic for %s", inner,
                     fwd, origin, "/".join(sorted(allowed)) or "nothing")
            return self._reject(fwd, "wrong_topic")
        self.accepted[msg.from_id + msg.seqno] = env
        while len(self.accepted) > self.max_pending:
            self.accepted.popitem(last=False)
        self.carried_by[origin] = fwd  # who brought this origin's messages first
        self.carried_by.move_to_end(origin)
        while len(self.carried_by) > self.max_pending:
            self.carried_by.popitem(last=False)
        return True

    def take(self, msg) -> Envelope | None:
        """The envelope accepted for `msg` (None if it was evicted)."""
        return self.accepted.pop(msg.from_id + msg.seqno, None)

    def reopen(self, msg) -> Envelope:
        """Decode again without the replay check (the validator already did it)."""
        return open_envelope(msg.data, limits=self.limits,
                             expected_sender=origin_b58(msg.from_id),
                             max_skew_s=self.max_skew_s)


def mesh_ready(router: GossipSub, pubsub: Pubsub, topic: str, degree_low: int) -> tuple[bool, int]:
    """(ready, topic peers): ready when our mesh (or fanout) holds at least
    min(topic peers, degree_low) peers."""
    topic_peers = len(pubsub.peer_topics.get(topic, ()))
    if topic in router.mesh:
        have = len(router.mesh[topic])
    else:
        have = topic_peers  # fanout: publishing picks from the topic's peers directly
    return topic_peers > 0 and have >= min(topic_peers, degree_low), topic_peers
