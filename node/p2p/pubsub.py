"""Gossip over py-libp2p's GossipSub (the pubsub seam of P2PNode): subscriptions and
in-order delivery, publishing with mesh and capacity waits, and large payloads announced
and pulled over FETCH_PROTOCOL. Methods named `_t_*` run in the libp2p (trio) thread."""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable

import trio
from libp2p.peer.id import ID

from ...protocol.envelope import Envelope, open_envelope
from ...protocol.errors import ProtocolError
from ...protocol.ids import FETCH_PROTOCOL, topic
from ...protocol.limits import TOPIC_MESSAGE_TYPES
from ...protocol.messages import PayloadAnnounce, WireModel
from .errors import PublishError, RequestError
from .gossip import CountingSendChannel, mesh_ready

log = logging.getLogger(__name__)

MESH_POLL_S = 0.02  # how often a first publish re-checks whether the mesh formed
QUEUE_POLL_S = 0.005  # how often a blocked publish re-checks the peer queues

Handler = Callable[[Envelope, str], Awaitable[None]]


class GossipService:
    """Topics of one P2PNode (`node` gives the host, pubsub, bridge, config, metrics)."""

    def __init__(self, node):
        self.node = node
        self.cfg = node.cfg
        self.metrics = node.metrics
        self.bridge = node._bridge
        self._subs: dict[str, list[Handler]] = {}
        self._queues: dict[str, asyncio.Queue] = {}
        self._published_topics: set[str] = set()
        self._payloads: OrderedDict[bytes, bytes] = OrderedDict()
        self._payload_bytes = 0
        self._fetch_sem = asyncio.Semaphore(node.cfg.payload_fetch_parallel)
        self._outbox: deque[tuple[str, Envelope, str]] = deque()  # libp2p thread -> asyncio
        self._flush_pending = False

    async def subscribe_pending(self) -> None:
        """At start: subscribe in the libp2p thread to the kinds subscribed before it."""
        for kind in self._subs:
            await self.bridge.call(self._t_subscribe, kind, self.topic(kind))

    def topic(self, kind: str) -> str:
        return topic(self.node.swarm_id, kind)

    async def subscribe(self, kind: str, handler: Handler) -> None:
        """Call `await handler(envelope, from_peer)` for every verified message on `kind`
        from other peers, one at a time in arrival order (GossipSub does not keep a sender's
        order across paths). May be called before or after start. Payload announcements are
        resolved first: the handler sees the pulled message, never the announcement."""
        t = self.topic(kind)
        first = kind not in self._subs
        self._subs.setdefault(kind, []).append(handler)
        if not first:
            return
        queue: asyncio.Queue = asyncio.Queue(self.cfg.subscription_queue)
        self._queues[kind] = queue
        self.node._spawn(self._consume(kind, queue))
        if self.node.running:  # else start() subscribes
            await self.bridge.call(self._t_subscribe, kind, t)

    async def _t_subscribe(self, kind: str, t: str) -> None:
        pubsub = self.node._pubsub
        pubsub.set_topic_validator(t, self.node._validator.for_kind(kind), False)
        await pubsub.subscribe(t)
        send, recv = trio.open_memory_channel(self.cfg.subscription_queue)
        pubsub.subscribed_topics_send[t] = CountingSendChannel(send, self.metrics)
        self.node._nursery.start_soon(self._t_read_topic, kind, recv)

    async def _t_read_topic(self, kind: str, recv) -> None:
        async for msg in recv:
            try:
                origin = ID(msg.from_id).to_base58()
            except Exception as e:  # noqa: BLE001 - validated already; defensive
                log.debug("unreadable origin on a validated message: %s", e)
                continue
            if origin == self.node.peer_id:
                self.metrics.inc("own_skipped")
                continue
            env = self.node._validator.take(msg)
            if env is None:
                try:
                    env = self.node._validator.reopen(msg)
                except ProtocolError as e:
                    self.metrics.reject(origin, e.reason)
                    continue
            self.metrics.inc("received")
            self._t_hand_over(kind, env, origin)

    def _t_hand_over(self, kind: str, env: Envelope, origin: str) -> None:
        # One wake-up of the asyncio loop per burst, not per message (each costs a write
        # to its self-pipe): the flush drains everything queued until it runs.
        self._outbox.append((kind, env, origin))
        if not self._flush_pending:
            self._flush_pending = True
            self.bridge.to_asyncio_nowait(self._flush)

    def _flush(self) -> None:
        self._flush_pending = False
        while self._outbox:
            kind, env, origin = self._outbox.popleft()
            try:
                self._queues[kind].put_nowait((env, origin))
            except asyncio.QueueFull:
                self.metrics.inc("drop_handler_queue_full")

    async def _consume(self, kind: str, queue: asyncio.Queue) -> None:
        while True:
            env, origin = await queue.get()
            if env.type == PayloadAnnounce.TYPE:
                self.node._spawn(self._pull_announced(kind, env, origin))
                continue
            await self._deliver(kind, env, origin)

    async def _deliver(self, kind: str, env: Envelope, origin: str) -> None:
        for handler in list(self._subs.get(kind, ())):
            try:
                await handler(env, origin)
                self.metrics.inc("delivered")
            except asyncio.CancelledError:
                raise
            except Exception:
                self.metrics.inc("handler_errors")
                log.exception("handler for %s failed on %s from %s", kind, env.type, origin)

    async def publish(self, kind: str, message: WireModel) -> None:
        """Seal `message` and gossip it on `kind`. Waits for the topic mesh (first publish)
        and for outbound queue capacity; raises PublishError(queue_full) only after
        `p2p.publish_timeout_s`. A sealed message above `p2p.inline_payload_max` is kept
        here and announced (PayloadAnnounce); subscribers pull it over FETCH_PROTOCOL."""
        t = self.topic(kind)
        if message.TYPE not in TOPIC_MESSAGE_TYPES.get(kind, ()):
            raise PublishError(f"a {message.TYPE} message may not be published on {kind}",
                               reason="wrong_topic")
        data = self.node.identity.seal(message)
        if len(data) > self.cfg.inline_payload_max:
            digest = hashlib.sha256(data).digest()
            self._store_payload(digest, data)
            data = self.node.identity.seal(PayloadAnnounce(inner_type=message.TYPE,
                                                      content_hash=digest, size=len(data)))
            self.metrics.inc("payload_announced")
        await self.bridge.call(self._t_publish, t, data)

    async def _t_publish(self, t: str, data: bytes) -> None:
        await self._t_wait_mesh(t)
        await self._t_wait_capacity()
        await self.node._pubsub.publish(t, data)
        self._published_topics.add(t)
        self.metrics.inc("published")

    async def _t_wait_mesh(self, t: str) -> None:
        if not self.node._host.get_connected_peers():
            self.metrics.inc("publish_no_peers")
            return
        first = t not in self._published_topics
        deadline = trio.current_time() + self.cfg.mesh_wait_s
        while True:
            ready, topic_peers = mesh_ready(self.node._router, self.node._pubsub, t,
                                            self.cfg.mesh_degree_low)
            if ready:
                return
            if (not first and topic_peers == 0) or trio.current_time() >= deadline:
                self.metrics.inc("publish_no_mesh")
                return
            await trio.sleep(MESH_POLL_S)

    async def _t_wait_capacity(self) -> None:
        queues = self.node._pubsub.peer_queues
        _, fullest = queues.fullest()
        if fullest <= self.cfg.publish_high_water:
            return
        self.metrics.inc("publish_waits")
        deadline = trio.current_time() + self.cfg.publish_timeout_s
        while True:
            await trio.sleep(QUEUE_POLL_S)
            peer, fullest = queues.fullest()
            if fullest <= self.cfg.publish_high_water:
                return
            if trio.current_time() >= deadline:
                raise PublishError(
                    f"outbound queue to {peer} still holds {fullest} messages after "
                    f"{self.cfg.publish_timeout_s:.0f}s (peer too slow or stalled)",
                    reason="queue_full")

    async def publish_raw(self, kind: str, data: bytes) -> None:
        """Gossip `data` as is, without sealing. For tests and tools that check how peers
        treat malformed traffic; the node itself never uses it."""
        await self.bridge.call(self._t_publish, self.topic(kind), bytes(data))

    def topic_peers(self, kind: str) -> list[str]:
        """Peers known to be subscribed to `kind` (a snapshot, for tests and status)."""
        peers = self.node._pubsub.peer_topics.get(self.topic(kind), ()) if self.node._pubsub else ()
        return sorted(p.to_base58() for p in list(peers))

    def mesh_peers(self, kind: str) -> list[str]:
        mesh = self.node._router.mesh.get(self.topic(kind), ()) if self.node._router else ()
        return sorted(p.to_base58() for p in list(mesh))

    # Large payloads -------------------------------------------------------------------

    def _store_payload(self, digest: bytes, data: bytes) -> None:
        if digest in self._payloads:
            return
        self._payloads[digest] = data
        self._payload_bytes += len(data)
        while self._payload_bytes > self.cfg.payload_cache_bytes and len(self._payloads) > 1:
            _, old = self._payloads.popitem(last=False)
            self._payload_bytes -= len(old)

    async def serve_payload(self, peer: str, body: bytes) -> bytes:
        data = self._payloads.get(body)
        if data is None:
            raise LookupError("payload not held here")
        return data

    async def _pull_announced(self, kind: str, env: Envelope, origin: str) -> None:
        ann: PayloadAnnounce = env.message
        inner_max = self.node.limits.max_for(ann.inner_type) + 4096
        if ann.size > inner_max:
            self.metrics.reject(origin, "too_large")
            return
        data = None
        async with self._fetch_sem:
            # The announcer first, then peers that may have pulled it already.
            sources = [origin] + [p for p in self.node.connected_peers() if p != origin][:3]
            for source in sources:
                try:
                    data = await self.node.request(source, FETCH_PROTOCOL, ann.content_hash,
                                              max_response=ann.size)
                    break
                except RequestError as e:
                    log.info("could not pull announced %s from %s: %s", ann.inner_type,
                             source, e)
        if data is None:
            self.metrics.inc("payload_fetch_failed")
            log.warning("could not pull announced %s of %s from any of %d peers",
                        ann.inner_type, origin, len(sources))
            return
        if len(data) != ann.size or hashlib.sha256(data).digest() != ann.content_hash:
            self.metrics.reject(origin, "hash_mismatch")
            return
        try:
            inner = open_envelope(data, limits=self.node.limits, expected_sender=origin,
                                  expected_type=ann.inner_type,
                                  replay_cache=self.node._validator.replay,
                                  max_skew_s=self.node.config.limits.max_clock_skew_s)
        except ProtocolError as e:
            self.metrics.reject(origin, e.reason)
            return
        self._store_payload(ann.content_hash, data)
        self.metrics.inc("payload_fetched")
        await self._deliver(kind, inner, origin)
