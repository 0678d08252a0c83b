"""Patches on pubsub's sending side: per-peer queues bounded in bytes with their drops
counted, and the RPCs queued for a peer sent as one write.

- py-libp2p 0.8.1's per-peer outbound queue holds 32 RPCs of any size (up to the 1 MiB RPC
  cap each) and drops the rest silently. `Pubsub.peer_queues` is replaced by `TunedQueues`:
  each queue py-libp2p registers is resized (`p2p.outbound_queue` slots) and bounded in
  bytes (`BoundedQueue`), and a refused push is counted (`drop_outbound_queue_full`).
- py-libp2p 0.8.1 writes each queued RPC separately (`Pubsub.handle_sending_messages`): one
  yamux frame, one Noise message and one socket write per forwarded message, and at the
  peer one frame-loop pass, read and parse each (~1.4 ms of Python per copy in the 8-peer
  benchmark). The replacement yields once after waking, then merges the publish-only RPCs
  waiting behind the first into it (an RPC may carry several messages; the wire format is
  unchanged), up to MERGED_RPC_MAX. Control RPCs (priority) and RPCs with subscriptions or
  control are never merged and keep their order."""

from __future__ import annotations

import logging
from collections.abc import Callable

import trio
from libp2p.pubsub.pubsub import Pubsub
from libp2p.pubsub.rpc_queue import PriorityQueue, RpcQueue
from libp2p.utils.varint import encode_uvarint

from .registry import Patch, has_signature, register, sets_attribute

log = logging.getLogger(__name__)

BOUNDED = register(Patch(
    name="bounded_send_queues",
    scope="pubsub",
    targets=("libp2p.pubsub.pubsub:Pubsub.peer_queues",),
    why="per-peer outbound queues hold 32 RPCs of up to 1 MiB each and drop the rest "
        "silently",
    upstream="none filed (searched 2026-09); go-libp2p-pubsub's queue is also bounded in "
             "RPCs only, but drops are traced",
    shape=lambda: (sets_attribute(Pubsub, "peer_queues")
                   + sets_attribute(RpcQueue, "_queue")
                   + has_signature(PriorityQueue, "push", ("self", "rpc", "priority"))
                   + sets_attribute(PriorityQueue, "_non_priority")
                   + sets_attribute(PriorityQueue, "_priority")),
))
COALESCE = register(Patch(
    name="coalesced_sends",
    scope="pubsub",
    targets=("libp2p.pubsub.pubsub:Pubsub.handle_sending_messages",),
    why="one write (frame, Noise message, socket write) per queued RPC",
    upstream="none filed (searched 2026-09)",
    shape=lambda: (has_signature(Pubsub, "handle_sending_messages",
                                 ("self", "peer_id", "stream", "queue"), coroutine=True)
                   + has_signature(Pubsub, "write_msg", ("self", "stream", "rpc_msg"),
                                   coroutine=True)),
    fingerprints={"libp2p.pubsub.pubsub:Pubsub.handle_sending_messages": "b2d3e118bbd148c0"},
))

# Inline payloads we accept from others (the default threshold before the payload plane)
# plus room for the pubsub framing around one envelope: a merged RPC stays within what every
# peer of ours accepts, whatever our own inline_payload_max.
ACCEPTED_INLINE_MAX = 256 * 1024
RPC_OVERHEAD = 16 * 1024
MERGED_RPC_MAX = ACCEPTED_INLINE_MAX + RPC_OVERHEAD


class BoundedQueue(PriorityQueue):
    """py-libp2p's per-peer RPC queue, bounded in bytes as well as in RPCs: a push that
    would take the queued bytes over `max_bytes` is refused like one over `max_size` (an
    empty queue takes any one RPC; the RPC size limit applies before)."""

    def __init__(self, max_size: int, max_bytes: int):
        super().__init__(max_size)
        self.max_bytes = max_bytes
        self.bytes = 0
        self.on_release: Callable[[], None] | None = None  # an RPC left the queue
        self.released = 0  # RPCs that left the queue so far: its progress
        # Set by a publish that found this queue over the high water and saw nothing leave
        # it for `p2p.publish_stall_s` (pubsub.py): publishes stop waiting for it until an
        # RPC leaves it again. `watched`: (`released`, when a publish first saw that count).
        self.stalled = False
        self.watched: tuple[int, float] | None = None

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
        self.released += 1
        self.stalled = False
        if self.on_release is not None:
            self.on_release()


class TunedQueues(dict):
    """Replaces Pubsub.peer_queues: each per-peer queue created by py-libp2p is resized
    (RPC slots, and bytes: BoundedQueue) as it is registered, and its rejected pushes are
    counted with `metrics.inc("drop_outbound_queue_full", n)`. `shorter()`, if set, is
    called (in the libp2p thread) whenever a queue got shorter or went away: a publish
    waiting for capacity (pubsub.py) waits on it, not on a timer."""

    def __init__(self, max_size: int, max_message_size: int, initial: dict,
                 metrics, max_bytes: int | None = None):
        super().__init__()
        self.shorter: Callable[[], None] | None = None
        self.metrics = metrics
        self.max_size = max_size
        self.max_message_size = max_message_size
        self.max_bytes = max_bytes if max_bytes is not None else max_size * max_message_size
        for peer_id, queue in initial.items():  # normally none: patched before connections
            self[peer_id] = queue

    def __setitem__(self, peer_id, queue) -> None:
        bounded = BoundedQueue(self.max_size, self.max_bytes)
        for rpc in queue._queue._priority:  # normally empty when registered
            bounded.push(rpc, priority=True)
        for rpc in queue._queue._non_priority:
            bounded.push(rpc)
        bounded.on_release = self._shorter
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

    def _shorter(self) -> None:
        if self.shorter is not None:
            self.shorter()

    def __delitem__(self, peer_id) -> None:
        super().__delitem__(peer_id)
        self._shorter()

    def pop(self, peer_id, *default):
        queue = super().pop(peer_id, *default)
        self._shorter()
        return queue

    def over(self, high_water: int) -> list[tuple[object, BoundedQueue]]:
        """(peer, queue) of each queue holding more than `high_water` RPCs that is not
        marked stalled (BoundedQueue.stalled)."""
        out = []
        for peer, queue in list(self.items()):
            bounded = queue._queue
            if len(bounded) > high_water and not bounded.stalled:
                out.append((peer, bounded))
        return out

    def fullest(self) -> tuple[object, int]:
        worst, worst_len = None, 0
        for peer, queue in list(self.items()):
            n = len(queue)
            if n > worst_len:
                worst, worst_len = peer, n
        return worst, worst_len


def patch_send_queues(pubsub, max_size: int, max_message_size: int, max_bytes: int,
                      metrics) -> TunedQueues:
    if not isinstance(pubsub.peer_queues, TunedQueues):
        pubsub.peer_queues = TunedQueues(max_size, max_message_size, pubsub.peer_queues,
                                         metrics, max_bytes)
    return pubsub.peer_queues


def patch_coalesced_sends(pubsub, metrics) -> None:
    """Merge the publish-only RPCs queued for a peer into one write (idempotent)."""
    if getattr(pubsub.handle_sending_messages, "_swarm_coalesce", False):
        return

    async def handle_sending_messages(peer_id, stream, queue) -> None:
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
