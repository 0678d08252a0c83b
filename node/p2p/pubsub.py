"""Gossip over py-libp2p's GossipSub (the pubsub seam of P2PNode): subscriptions and
in-order delivery, publishing with mesh and capacity waits, and large payloads announced,
pushed by their publisher to the subscribers it has a push link with (gossip_push.py), and
otherwise pulled once per peer (over the bulk plane, bodies.py, else FETCH_PROTOCOL).
Methods named `_t_*` run in the libp2p (trio) thread."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import trio

from ...protocol.envelope import Envelope, open_envelope, seal
from ...protocol.errors import ProtocolError
from ...protocol.ids import FETCH_PROTOCOL, topic
from ...protocol.limits import DEFAULT_TOPIC_RATES, OTHER_TOPIC_RATE, TOPIC_MESSAGE_TYPES
from ...protocol.messages import PayloadAnnounce, WireModel
from . import patches
from .bodies import KIND as BODY_KIND
from .bodies import BodyPuller, BodyServer, PullFailed
from .bulk import BulkPlane
from .context import HostContext
from .errors import PublishError, RequestError
from .gossip import GossipValidator, mesh_ready, origin_b58
from .gossip_push import KIND as PUSH_KIND
from .gossip_push import BodyPusher
from .penalties import TokenBuckets
from .reachability import Verdict
from .requests import RequestService

log = logging.getLogger(__name__)

# How often a topic's first publish looks again whether its mesh formed: py-libp2p changes
# the mesh and the peers' subscriptions in its own code, which signals nothing.
MESH_POLL_S = 0.02
# Announced pulls of one announcer waiting for its pull slots; more are dropped (counted
# payload_pull_queue_full). An announce is ~150 bytes plus its waiting task.
PULL_QUEUE_PER_ANNOUNCER = 256
# An announcer that did not serve a pull of its own body (`unserved_announce`) loses its
# place at once: none of its announces is pulled for STALL_S, then one trial pull; each
# further unserved trial doubles the wait, up to STALL_MAX_S; a served body ends it. (5
# points per unserved pull, scores halving every 60 s: 24 stalling identities sharing 8
# unproven slots are pulled once per ~30 s each and never reached the cut at 100.)
STALL_S = 30.0
STALL_MAX_S = 600.0
# An unproven announcer (none of its bodies verified here yet) asked for its own body on a
# direct connection must begin its answer within this (or HEDGE_FACTOR times the hedge
# deadline, if longer: a node whose every ask is slow) from the moment the ask has one of
# the peer's connection slots (payload_pulls_per_peer: a wait for our own slot is not the
# peer's fault), the connection's set-up included;
# else the ask ends as any timeout of an announcer does (`unserved_announce`, a stall), so a
# fresh stalling identity holds an unproven pull slot this long, not a pull timeout (10 s).
# An honest announcer on the WAN lab's worst path (200 ms RTT, 0.5% loss per leg, 100 ms
# TBF queues) answers on a warm connection in 1 RTT + 2 queues = 0.4 s; on a fresh one (an
# endpoint query on a libp2p stream, TCP, TLS 1.3, the hello, the request: ~7 RTT) in ~1.6
# s, 2.6 s with its SYN lost once (1 s initial RTO), ~3.2 s with a data segment lost too;
# the answer's header goes out ahead of the body, so the body's size (up to 16 MiB) does
# not count. A relayed or dialled announcer gets no such deadline (a slow path is no
# offence there), nor does a proven one.
FIRST_ANSWER_S = 4.0
# A source that does not hold an announced body yet (a forwarder that is pulling it itself:
# announces travel ahead of their bodies) is asked again after this, doubling up to the max.
PULL_RETRY_S = 0.05
PULL_RETRY_MAX_S = 1.0
# How long the direct sources of a body are asked (and asked again) before the ones reached
# through a relay, or by a dial: a public peer that pulled it is faster than a relayed path.
RELAYED_AFTER_S = 1.0
# Peers asked for a body besides its announcer and forwarder at first (the peers that hold
# it may be any of the connected ones: the others are asked after them, PULL_PASS at a time).
PULL_OTHERS = 3
PULL_PASS = 4
# A pull's ask is hedged after p2p.payload_pull_hedge_s, or after HEDGE_FACTOR times the
# median of this node's last HEDGE_SAMPLES answered asks if that is longer: on a machine
# or uplink where every pull is slow, a fixed deadline would double most pulls' requests.
HEDGE_FACTOR = 2.0
HEDGE_SAMPLES = 64
# A pull of a body this node is fetching itself is answered when it lands, within this
# (then "not held"): below the hedge (p2p.payload_pull_hedge_s, 1 s by default).
HOLD_S = 0.8

Handler = Callable[[Envelope, str], Awaitable[None]]


@dataclass
class BodyTrace:
    """Where one announced body's time went at this node (GossipService.on_body: for
    benchmarks, which print the breakdown). Times in seconds of `time.monotonic`."""

    origin: str
    announced: float  # its announce reached the handler
    via: str = "failed"  # push, pull, or failed
    push_waited: float = 0.0  # waiting for a push (held already: 0)
    queued: float = 0.0  # waiting for a pull slot
    pulling: float = 0.0  # asking sources until one served it
    asks: int = 0  # sources asked (each a request round trip)
    source: str = ""  # who served the pull (the origin: one hop; another: two or more)
    hedged: bool = False  # an ask stalled past p2p.payload_pull_hedge_s: others were asked
    hedge_won: bool = False  # ... and one of them served first


@dataclass
class _Hedge:
    """One pull's hedge (at most one): `candidates` are the sources a hedge asks, less the
    one whose ask stalled."""

    after_s: float
    candidates: list[str]
    used: bool = False


class GossipService:
    """Topics of one P2PNode: `validator` checks what arrives (gossip.py), `requests` and
    `bulk` carry announced bodies, `report(peer, reason=...)` charges a peer for a bad one."""

    def __init__(self, ctx: HostContext, validator: GossipValidator, requests: RequestService,
                 bulk: BulkPlane, report: Callable[..., object]):
        self.ctx = ctx
        self.cfg = ctx.cfg
        self.metrics = ctx.metrics
        self.bridge = ctx.bridge
        self.validator = validator
        self.requests = requests
        self.bulk = bulk
        self.report = report
        self._subs: dict[str, list[Handler]] = {}
        self._queues: dict[str, asyncio.Queue] = {}
        self._published_topics: set[str] = set()
        self._payloads: OrderedDict[bytes, bytes] = OrderedDict()
        self._coming: dict[bytes, asyncio.Event] = {}  # bodies being fetched: set on arrival
        self._payload_bytes = 0
        self.pull_slots = PullSlots(ctx.cfg.payload_fetch_parallel)
        self._ask_s: deque[float] = deque(maxlen=HEDGE_SAMPLES)  # answered asks' durations
        self._outbox: deque[tuple[str, Envelope, str]] = deque()  # libp2p thread -> asyncio
        self._flush_pending = False
        # bodies over the bulk plane (bodies.py), set by start_bodies: served and pulled
        self.body_server: BodyServer | None = None
        self.puller: BodyPuller | None = None
        self.pusher: BodyPusher | None = None  # bodies pushed by their publisher
        self._early_rate = TokenBuckets(max_buckets=16384)  # early forwards: (origin, kind)
        self._t_shorter: trio.Event | None = None  # set when an outbound queue shrinks
        self.on_body: Callable[[BodyTrace], None] | None = None  # a benchmark's probe

    async def subscribe_pending(self) -> None:
        """At start: subscribe in the libp2p thread to the kinds subscribed before it."""
        for kind in self._subs:
            await self.bridge.call(self._t_subscribe, kind, self.topic(kind))

    def topic(self, kind: str) -> str:
        return topic(self.ctx.swarm_id, kind)

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
        self.ctx.spawn(self._consume(kind, queue), f"consume {kind}")
        if self.ctx.running:  # else start() subscribes
            await self.bridge.call(self._t_subscribe, kind, t)

    async def _t_subscribe(self, kind: str, t: str) -> None:
        pubsub = self.ctx.pubsub
        pubsub.set_topic_validator(t, self.validator.for_kind(kind), False)
        await pubsub.subscribe(t)
        recv = patches.patch_subscription_channel(
            pubsub, t, self.cfg.subscription_queue,
            lambda: self.metrics.inc("drop_subscription_full"))
        self.ctx.nursery.start_soon(self._t_read_topic, kind, recv)

    async def _t_read_topic(self, kind: str, recv) -> None:
        async for msg in recv:
            try:
                origin = origin_b58(msg.from_id)
            except Exception as e:  # noqa: BLE001 - validated already; defensive
                log.debug("unreadable origin on a validated message: %s", e)
                continue
            if origin == self.ctx.peer_id:
                self.metrics.inc("own_skipped")
                continue
            env = self.validator.take(msg)
            if env is None:
                try:
                    env = self.validator.reopen(msg)
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
                self.ctx.spawn(self._pull_announced(kind, env, origin), "pull announced")
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
        here, pushed to the subscribers we have a push link with, and announced
        (PayloadAnnounce); the others pull it (bulk plane, else FETCH_PROTOCOL)."""
        t = self.topic(kind)
        if message.TYPE not in TOPIC_MESSAGE_TYPES.get(kind, ()):
            raise PublishError(f"a {message.TYPE} message may not be published on {kind}",
                               reason="wrong_topic")
        data = self._seal(message)
        if len(data) > self.cfg.inline_payload_max:
            digest = hashlib.sha256(data).digest()
            self.store_payload(digest, data)
            if self.pusher is not None:  # the bodies start before their announce
                self.pusher.push(digest, data, self.cfg.payload_push_fanout,
                                 set(self.topic_peers(kind)), via=self.cfg.payload_push_via)
            data = self._seal(PayloadAnnounce(inner_type=message.TYPE, content_hash=digest,
                                              size=len(data)))
            self.metrics.inc("payload_announced")
        await self.bridge.call(self._t_publish, t, data)

    def _seal(self, message: WireModel) -> bytes:
        # The node's cached peer id: Identity.seal derives it from the key on every call.
        return seal(message, self.ctx.identity.private_key, self.ctx.peer_id)

    async def _t_publish(self, t: str, data: bytes) -> None:
        await self._t_wait_mesh(t)
        await self._t_wait_capacity()
        await self.ctx.pubsub.publish(t, data)
        self._published_topics.add(t)
        self.metrics.inc("published")

    async def _t_wait_mesh(self, t: str) -> None:
        if not self.ctx.host.get_connected_peers():
            self.metrics.inc("publish_no_peers")
            return
        if t in self._published_topics:
            # Only a topic's first publish waits for the mesh (the peers' subscriptions may
            # still be on their way). Later ones go at once to what the mesh, fanout or flood
            # publishing holds: waiting here held every publish for mesh_wait_s whenever mesh
            # maintenance (GRAFT/PRUNE churn) left the mesh below D_low, which at mesh
            # degree 3 made rounds late by seconds and lost them to the benchmark's drain.
            return
        deadline = trio.current_time() + self.cfg.mesh_wait_s
        while True:
            ready, topic_peers = mesh_ready(self.ctx.router, self.ctx.pubsub, t,
                                            self.cfg.mesh_degree_low)
            # Flood publishing sends to every subscribed peer: known subscribers suffice (a
            # mesh below D_low after GRAFT/PRUNE churn held a first publish for mesh_wait_s).
            if ready or (self.cfg.flood_publish and topic_peers > 0):
                return
            if trio.current_time() >= deadline:
                self.metrics.inc("publish_no_mesh")
                return
            await trio.sleep(MESH_POLL_S)

    async def _t_wait_capacity(self) -> None:
        """Until every outbound peer queue is at most `publish_high_water` long, woken by
        each RPC that leaves a queue (TunedQueues.shorter); PublishError after
        `publish_timeout_s`. A queue over the high water from which nothing left for
        `publish_stall_s` (a peer behind a partition or a dead path whose connection the
        liveness check has not closed yet) is marked stalled and not waited for until an RPC
        leaves it: one dead peer must not hold every publish of this node (issue 27: a
        trainer held its checkpoints 43 s across a partition's heal). Its queue keeps its
        bounds; what goes past them is dropped and counted (drop_outbound_queue_full)."""
        queues = self.ctx.pubsub.peer_queues
        high = self.cfg.publish_high_water
        if not queues.over(high):
            return
        self.metrics.inc("publish_waits")
        queues.shorter = self._t_queue_shorter
        deadline = trio.current_time() + self.cfg.publish_timeout_s
        while True:
            now = trio.current_time()
            wake = deadline
            for peer, queue in queues.over(high):
                if queue.watched is None or queue.watched[0] != queue.released:
                    queue.watched = (queue.released, now)  # progress since: watch it afresh
                stalled_at = queue.watched[1] + self.cfg.publish_stall_s
                if now < stalled_at:
                    wake = min(wake, stalled_at)
                    continue
                queue.stalled = True
                self.metrics.inc("publish_stalled_queues")
                log.info("gossip to %s: nothing left its outbound queue (%d RPCs) for %.0fs; "
                         "publishes go on without waiting for it (what does not fit is "
                         "dropped) until it moves or the connection is closed",
                         str(peer)[-8:], len(queue), now - queue.watched[1])
            if not queues.over(high):
                return
            if now >= deadline:
                break
            if self._t_shorter is None:
                self._t_shorter = trio.Event()
            with trio.move_on_after(wake - now):
                await self._t_shorter.wait()
        peer, fullest = queues.fullest()
        raise PublishError(f"outbound queue to {peer} still holds {fullest} messages after "
                           f"{self.cfg.publish_timeout_s:.0f}s (peer too slow or stalled)",
                           reason="queue_full")

    def _t_queue_shorter(self) -> None:
        """An outbound queue got shorter or went away: wake the publishes waiting."""
        waiting, self._t_shorter = self._t_shorter, None
        if waiting is not None:
            waiting.set()

    async def publish_raw(self, kind: str, data: bytes) -> None:
        """Gossip `data` as is, without sealing. For tests and tools that check how peers
        treat malformed traffic; the node itself never uses it."""
        await self.bridge.call(self._t_publish, self.topic(kind), bytes(data))

    def topic_peers(self, kind: str) -> list[str]:
        """Peers known to be subscribed to `kind` (a snapshot, for tests and status)."""
        pubsub = self.ctx.pubsub
        peers = pubsub.peer_topics.get(self.topic(kind), ()) if pubsub is not None else ()
        return sorted(p.to_base58() for p in list(peers))

    def mesh_peers(self, kind: str) -> list[str]:
        router = self.ctx.router
        mesh = router.mesh.get(self.topic(kind), ()) if router is not None else ()
        return sorted(p.to_base58() for p in list(mesh))

    # Large payloads -------------------------------------------------------------------

    def store_payload(self, digest: bytes, data: bytes) -> None:
        """Keep `data` as the body announced under `digest`, for the peers that pull it (a
        bounded cache, oldest out first; a digest already held keeps its first body)."""
        event = self._coming.get(digest)
        if event is not None:
            event.set()
        if digest in self._payloads:
            return
        self._payloads[digest] = data
        self._payload_bytes += len(data)
        while self._payload_bytes > self.cfg.payload_cache_bytes and len(self._payloads) > 1:
            _, old = self._payloads.popitem(last=False)
            self._payload_bytes -= len(old)

    async def body_coming(self, digest: bytes) -> bytes | None:
        """The body of `digest` if this node is fetching it and it lands within HOLD_S."""
        event = self._coming.get(digest)
        if event is None:
            return None
        self.metrics.inc("payload_bulk_holds")
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(HOLD_S):
                await event.wait()
        return self._payloads.get(digest)

    async def serve_payload(self, peer: str, body: bytes) -> bytes:
        """FETCH_PROTOCOL: the payload held under the 32-byte hash `body` (libp2p path)."""
        data = self._payloads.get(body)
        if data is None:
            raise LookupError("payload not held here")
        return data

    def start_bodies(self) -> None:
        """At start: serve and pull bodies over the node's bulk plane (kind "body"); the
        announcers that served us have its reserve of connections."""
        bulk, cfg = self.bulk, self.ctx.config.bulk
        self.body_server = BodyServer(self._payloads.get, cfg.idle_s,
                                      self.cfg.payload_pull_timeout_s, self.metrics,
                                      coming=self.body_coming)
        bulk.register(BODY_KIND, self.body_server.serve)
        bulk.client.add_kind(BODY_KIND, "gossip bodies", self.cfg.payload_pulls_per_peer,
                             cfg.idle_s / 2)
        bulk.add_known(self.pull_slots.proven)
        self.puller = BodyPuller(bulk.client, self.cfg, self.metrics, spawn=self.ctx.spawn)
        if self.cfg.payload_push_fanout > 0:
            limits = self.ctx.limits
            self.pusher = BodyPusher(
                bulk.client, self.cfg, self.metrics,
                max_size=lambda: limits.max_envelope() + 4096,
                held=lambda d: d in self._payloads, charge=self._reject_body,
                spawn=self.ctx.spawn, reachable=self._public, member=self._member,
                me=self.ctx.peer_id, early=self._opens_pushed)
            bulk.register(PUSH_KIND, self.pusher.serve)
            bulk.client.add_kind(PUSH_KIND, "pushed gossip bodies", 1, cfg.idle_s / 2)
            # found to be behind NAT: links the other way to the peers connected already
            self.ctx.reach.subscribe(
                lambda _: self._public() or self.peers_connected(
                    set(self.ctx.peers.connected_peers()), warm=False))

    def _opens_pushed(self, pusher: str, data: bytes) -> list[str] | None:
        """BodyPusher's `early`: the subscribers of the body's topic if `data` is an
        envelope `pusher` signed itself that opens (signature, sizes, a type one topic
        allows, timestamp within the skew the replay cache enforces: the cache itself is
        left to the announce's open) and the pusher's early forwards of that topic are within
        its per-origin rate (a token bucket at the topic's rate, besides the one its
        announces pass: bodies it pushes and never announces are forwarded no faster).
        None: forward after the announce's check, as before."""
        replay = self.validator.replay
        skew = self.ctx.config.limits.max_clock_skew_s
        try:
            env = open_envelope(data, limits=self.ctx.limits, expected_sender=pusher,
                                max_skew_s=min(skew, replay.window_s / 2))
        except ProtocolError:
            return None
        kind = next((k for k, types in TOPIC_MESSAGE_TYPES.items() if env.type in types), None)
        if kind is None or kind not in self._subs:
            return None
        rates = getattr(self.validator.admission, "rates", None) or DEFAULT_TOPIC_RATES
        if not self._early_rate.take((pusher, kind), rates.get(kind, OTHER_TOPIC_RATE)):
            self.metrics.inc("payload_push_early_rate_limited")
            return None
        return self.topic_peers(kind)

    def _member(self, peer: str) -> bool:
        return peer in self.ctx.peers.connected_peers()

    def _public(self) -> bool:
        """Known to be publicly reachable (peers dial our plane: no RECEIVE links needed)."""
        # without a plane of our own nobody can dial one: public over libp2p is not enough
        # (a node with bulk.listen off found public before its first push link went without
        # the link the other way, and never got pushes: a flaky test's cause)
        return self.ctx.reach.current.verdict == Verdict.PUBLIC and self.bulk.listening

    def peers_connected(self, peers: set[str], warm: bool = True) -> None:
        """New libp2p connections: open one bulk-plane connection to each now
        (BodyPuller.warm), not on the path of their first announced payload, and the
        push links (gossip_push.py)."""
        if self.puller is None:
            return
        for peer in peers:
            if warm and self.puller.usable(peer):
                self.ctx.spawn(self.puller.warm(peer), "warm bulk")
            if self.pusher is not None:
                self.ctx.spawn(self.pusher.connect(peer), "push link")

    async def _pull_announced(self, kind: str, env: Envelope, origin: str) -> None:
        ann: PayloadAnnounce = env.message
        if ann.size > self.ctx.limits.max_for(ann.inner_type) + 4096:
            self._reject_body(origin, "too_large")  # refused before a byte is pulled
            return
        digest = ann.content_hash
        if digest in self._coming or digest in self._payloads:
            await self._fetch_announced(kind, env, origin)
            return
        self._coming[digest] = asyncio.Event()
        try:
            await self._fetch_announced(kind, env, origin)
        finally:
            self._coming.pop(digest).set()  # a failed fetch: its waiting pulls end now

    async def _fetch_announced(self, kind: str, env: Envelope, origin: str) -> None:
        ann: PayloadAnnounce = env.message
        clock = time.monotonic
        trace = BodyTrace(origin, clock())
        data = None
        if self.pusher is not None:  # pushed to us already, or on its way
            data = await self.pusher.wait(ann.content_hash, ann.size,
                                          self.pusher.push_wait(origin))
            trace.push_waited, trace.via = clock() - trace.announced, "push"
        if data is None:
            if self.pull_slots.stalled(origin):  # it did not serve: no pull till STALL_S
                self.metrics.inc("payload_pull_stalled_announcer")
                return
            slot = self.pull_slots.claim(origin)
            if slot is None:  # this announcer already has that many pulls waiting
                self.metrics.inc("payload_pull_queue_full")
                return
            t0 = clock()
            async with slot as go:
                if not go:  # it failed to serve another pull while this one waited
                    self.metrics.inc("payload_pull_stalled_announcer")
                    return
                trace.queued, t0 = clock() - t0, clock()
                data, pushed = await self._pull_or_push(ann, origin, trace)
                trace.pulling = clock() - t0
            if self.pusher is not None and not pushed:
                self.pusher.pulled(ann.content_hash)
            trace.via = "push" if pushed else "pull" if data is not None else "failed"
        if self.on_body is not None:
            self.on_body(trace)
        if data is None:
            self.pull_slots.failed(origin)
            self.metrics.inc("payload_fetch_failed")
            log.warning("could not pull the announced %s of %s from any source",
                        ann.inner_type, origin)
            return
        try:  # only bytes that match the signed announce get here
            inner = open_envelope(data, limits=self.ctx.limits, expected_sender=origin,
                                  expected_type=ann.inner_type,
                                  replay_cache=self.validator.replay,
                                  max_skew_s=self.ctx.config.limits.max_clock_skew_s)
        except ProtocolError as e:
            self.pull_slots.failed(origin)
            self._reject_body(origin, e.reason)
            return
        self.pull_slots.served(origin)
        self.store_payload(ann.content_hash, data)
        if self.pusher is not None:  # to the peers its pusher named, if it named any
            self.pusher.forward(ann.content_hash, data, origin, self.topic_peers(kind))
        self.metrics.inc("payload_fetched")
        await self._deliver(kind, inner, origin)

    async def _pull_or_push(self, ann: PayloadAnnounce, origin: str,
                            trace: BodyTrace) -> tuple[bytes | None, bool]:
        """Pull the announced body, and take a push of it instead if one lands first; the
        other side is cancelled. (The body or None, whether it came by push.) A push that
        lands after the announce's push wait (PUSH_WAIT_S) is most often a forward: a
        public peer pushes a NAT'd origin's body on only once it checked the announce
        itself. In the 12-node WAN lab forwards landed 0.43 s (p50) / 0.72 s (p95) into
        the round, while the pulls begun 0.3 s after their announce took 1.1-1.7 s, and
        fetch_payload looks for a push only between its asks (each a round trip or more):
        the pulls decided every round's figure (RESULTS "wan: gossip")."""
        pull = asyncio.ensure_future(self.fetch_payload(ann, origin, trace=trace))
        if self.pusher is None:
            return await pull, False
        push = asyncio.ensure_future(self.pusher.landed(ann.content_hash, ann.size))
        try:
            done, _ = await asyncio.wait((pull, push), return_when=asyncio.FIRST_COMPLETED)
            if push in done:
                self.metrics.inc("payload_push_overtook_pull")
                return push.result(), True
            return pull.result(), False
        finally:
            for task in (pull, push):
                task.cancel()
            await asyncio.gather(pull, push, return_exceptions=True)

    def pull_sources(self, origin: str) -> list[str]:
        """Where to pull an announced payload, best first: the announcer, the peer that
        brought us its messages (it validated the announce, so it is pulling or holds it),
        then up to PULL_OTHERS other connected peers (public ones first); those on a direct
        connection before those reached only through a relay (a body over a relay crosses
        two links and the relay's circuit limits, and a relayed announcer's slow home uplink
        is shared by everyone pulling from it: a direct peer that pulled it already is
        faster). The forwarder goes before an announcer whose bulk plane we cannot use
        (behind NAT: libp2p streams through its home uplink) if we can use the forwarder's.
        An announcer we hold no connection to goes last: it came through the mesh
        because we cannot reach it (both behind NAT, no relayed path), and a pull from it
        waits out a dial."""
        return self._pull_candidates(origin)[0]

    def _pull_candidates(self, origin: str) -> tuple[list[str], list[str]]:
        """(pull_sources, the other directly connected peers in the same order: asked,
        PULL_OTHERS more at a time, while the first ones do not hold the body yet)."""
        peers = self.ctx.peers
        connected = peers.connected_peers()
        puller = self.puller
        carrier = self.validator.carried_by.get(origin)
        first = [p for p in dict.fromkeys([origin, carrier]) if p]
        if (len(first) == 2 and puller is not None and puller.usable(carrier)
                and not puller.usable(origin)):
            # an origin whose plane we cannot use (behind NAT) serves over libp2p streams
            # through its home uplink; the carrier on a plane we can use (a public peer it
            # pushed to, or fetching it itself: answered when it lands) first
            first.reverse()
        # of the others, public ones first (a plane we can use): an announcer behind NAT
        # dials out to them, so they pull its body first-hand
        others = sorted((p for p in connected if p not in first),
                        key=lambda p: (peers.is_relayed(p),
                                       puller is not None and not puller.usable(p)))
        ordered = first + others[:PULL_OTHERS]
        direct = [p for p in ordered if p in connected and not peers.is_relayed(p)]
        relayed = [p for p in ordered if p in connected and peers.is_relayed(p)]
        spare = [p for p in others[PULL_OTHERS:] if not peers.is_relayed(p)]
        return direct + relayed + [p for p in ordered if p not in connected], spare

    async def fetch_payload(self, ann: PayloadAnnounce, origin: str,
                            sources: list[str] | None = None,
                            trace: BodyTrace | None = None,
                            hedge: bool = True) -> bytes | None:
        """The announced body from the first source that serves it, checked against the
        announce's size and hash (before anything decodes it); None if no source did.
        A source that serves other bytes, or an announcer that does not serve, is counted
        and penalised. Sources on a direct connection are asked first, PULL_PASS at a time
        (asks are one after another: each is a round trip); those that do not hold it yet
        (a forwarder still pulling it itself) or are busy go to the back of the line, behind
        the other directly connected peers not asked yet, and the next PULL_PASS are asked
        after PULL_RETRY_S doubling, until `p2p.payload_pull_timeout_s` after the first ask.
        Sources reached only through a relay are asked once, when no direct source is left
        to ask or after RELAYED_AFTER_S; a source not connected at all (a dial, which may
        take `dial_timeout_s`) once, last. `sources`: exactly these, in this order;
        `trace`: counts the asks and names the source that served.

        Hedged (`hedge`, `p2p.payload_pull_hedge_s` > 0): an ask that has not answered after
        that long does not hold up the pull. The other sources are asked meanwhile (a second
        fetch_payload over them, not hedged again); the first verified body wins and the
        other side is cancelled. A cancelled ask is not charged: a slow source (a NAT'd
        origin on a home uplink) is no offence, and its pull is bounded by the timeout."""
        peers = self.ctx.peers
        if sources is None:
            todo, spare = self._pull_candidates(origin)
        else:
            todo, spare = list(sources), []
        hedger = (_Hedge(self.hedge_after_s(), todo + spare)
                  if hedge and self.cfg.payload_pull_hedge_s > 0 else None)
        connected = set(peers.connected_peers())
        relayed = [p for p in todo if p in connected and peers.is_relayed(p)]
        dial = [p for p in todo if p not in connected]
        if len(relayed) + len(dial) < len(todo):
            todo = [p for p in todo if p not in relayed and p not in dial]
        else:  # no direct source: ask them in order
            relayed, dial = [], []
        line = deque(todo[:PULL_PASS] + spare + todo[PULL_PASS:])
        loop = asyncio.get_running_loop()
        now = loop.time()
        deadline, relay_at = now + self.cfg.payload_pull_timeout_s, now + RELAYED_AFTER_S
        pause = PULL_RETRY_S
        while True:
            pushed = self.pusher.claim(ann.content_hash, ann.size) if self.pusher else None
            if pushed is not None:  # a push that came while we pulled
                return pushed
            if line:
                ask = [line.popleft() for _ in range(min(PULL_PASS, len(line)))]
                data, again = await self._pull_pass(ann, origin, ask, trace, hedger)
                if data is not None:
                    return data
                if self._hedged_and_stalled(hedger, origin):
                    # going on through the line asked nobody, one back-off sleep per
                    # PULL_PASS of it: 2.55 s of a slot per stalling identity's pull
                    return None
                line.extend(again)
            if relayed and (not line or loop.time() >= relay_at):
                data, _ = await self._pull_pass(ann, origin, relayed, trace, hedger)
                if data is not None:
                    return data
                relayed = []  # the direct ones may hold it now: one more ask at least
                deadline = max(deadline, loop.time() + 2 * pause)
            if not line or deadline - loop.time() <= pause:
                # last: a dial (it may wait out dial_timeout_s) to an announcer we are not
                # connected to, once nobody else is left to ask
                if not dial:
                    return None
                data, _ = await self._pull_pass(ann, origin, dial, trace, hedger)
                return data
            self.metrics.inc("payload_pull_retries")
            await asyncio.sleep(pause)
            pause = min(pause * 2, PULL_RETRY_MAX_S)

    def _hedged_and_stalled(self, hedge: _Hedge | None, origin: str) -> bool:
        """The announcer did not serve (stalled) and the hedge asked the others already:
        the pull is over."""
        return hedge is not None and hedge.used and self.pull_slots.stalled(origin)

    async def _pull_pass(self, ann: PayloadAnnounce, origin: str, sources: list[str],
                         trace: BodyTrace | None = None, hedge: _Hedge | None = None
                         ) -> tuple[bytes | None, list[str]]:
        """Ask each source in turn: the checked body, or None and the sources to ask again."""
        again = []
        for source in sources:
            if self._hedged_and_stalled(hedge, origin):
                # the hedge asked the others already and the announcer did not serve:
                # asking them again in a row held a slot a pull timeout per stalling peer
                return None, []
            if hedge is None or hedge.used:
                data, retry = await self._ask(source, ann, origin, trace)
            else:
                data, retry = await self._ask_hedged(source, ann, origin, trace, hedge)
            if data is not None:
                return data, []
            if retry:
                again.append(source)
        return None, again

    def hedge_after_s(self) -> float:
        """How long an ask may go unanswered before its pull is hedged (HEDGE_FACTOR)."""
        times = sorted(self._ask_s)
        typical = times[len(times) // 2] if times else 0.0
        return max(self.cfg.payload_pull_hedge_s, HEDGE_FACTOR * typical)

    async def _ask(self, source: str, ann: PayloadAnnounce, origin: str,
                   trace: BodyTrace | None) -> tuple[bytes | None, bool]:
        """One source asked once: (the checked body or None, whether to ask it again)."""
        if trace is not None:
            trace.asks += 1
        t0 = time.monotonic()
        try:
            data = await self._pull_from(source, ann, self._first_answer_s(source, origin))
        except PullFailed as e:
            return None, self._pull_failed(source, origin, e)
        self._ask_s.append(time.monotonic() - t0)
        if len(data) != ann.size or hashlib.sha256(data).digest() != ann.content_hash:
            self._reject_body(source, "hash_mismatch")
            return None, False
        if trace is not None:
            trace.source = source
        return data, False

    async def _ask_hedged(self, source: str, ann: PayloadAnnounce, origin: str,
                          trace: BodyTrace | None, hedge: _Hedge) -> tuple[bytes | None, bool]:
        """`_ask`, and if it has not answered within `hedge.after_s`, the other candidates
        too (a fetch_payload over them, one more ask at a time at most): the first verified
        body wins, the other side is cancelled (no charge for a cancelled ask)."""
        ask = asyncio.ensure_future(self._ask(source, ann, origin, trace))
        second: asyncio.Future | None = None
        try:
            done, _ = await asyncio.wait({ask}, timeout=hedge.after_s)
            others = [p for p in hedge.candidates if p != source]
            if done or not others:
                return await ask
            hedge.used = True
            self.metrics.inc("payload_pull_hedges")
            if trace is not None:
                trace.hedged = True
            second = asyncio.ensure_future(
                self.fetch_payload(ann, origin, sources=others, trace=trace, hedge=False))
            pending: set[asyncio.Future] = {ask, second}
            while pending:
                done, pending = await asyncio.wait(pending,
                                                   return_when=asyncio.FIRST_COMPLETED)
                if ask in done and ask.result()[0] is not None:
                    return ask.result()
                if ask in done and self.pull_slots.stalled(origin):
                    return None, False  # the announcer did not serve: the other side ends
                if second in done and second.result() is not None:
                    self.metrics.inc("payload_pull_hedge_won")
                    if trace is not None:
                        trace.hedge_won = True
                    return second.result(), False
            return None, ask.result()[1]
        finally:
            for task in (ask, second):
                if task is not None and not task.done():
                    task.cancel()

    def _first_answer_s(self, source: str, origin: str) -> float | None:
        """Within how long `source` must begin its answer (FIRST_ANSWER_S): only an
        unproven announcer asked for its own body on a direct connection."""
        peers = self.ctx.peers
        if (source != origin or self.pull_slots.proven(origin)
                or origin not in peers.connected_peers() or peers.is_relayed(origin)):
            return None
        return max(FIRST_ANSWER_S, HEDGE_FACTOR * self.hedge_after_s())

    async def _pull_from(self, source: str, ann: PayloadAnnounce,
                         first_answer_s: float | None = None) -> bytes:
        """Over the bulk plane when the source has one, else over libp2p. `first_answer_s`:
        within how long the answer must begin once the ask has a connection slot
        (PullFailed `timeout`)."""
        puller = self.puller
        if puller is not None and puller.usable(source):
            try:
                data = await puller.pull(source, ann.content_hash, ann.size, first_answer_s)
            except PullFailed as e:
                if e.reason != "unavailable":
                    raise
            else:
                self.metrics.inc("payload_pulled_bulk")
                return data
        elif puller is not None:
            puller.say_libp2p(source)
        try:
            data = await self.requests.request(source, FETCH_PROTOCOL, ann.content_hash,
                                           timeout=self.cfg.payload_pull_timeout_s,
                                           max_response=ann.size,
                                           first_answer=first_answer_s)
        except RequestError as e:
            reason = "not_held" if e.reason == "remote_error" else e.reason
            raise PullFailed(str(e), reason) from None
        self.metrics.inc("payload_pulled_libp2p")
        return data

    def _pull_failed(self, source: str, origin: str, e: PullFailed) -> bool:
        """Count (and charge, where it is an offence) one failed pull; True if `source`
        may be asked again (it may hold the body later)."""
        log.info("could not pull an announced payload of %s from %s: %s", origin[-8:],
                 source[-8:], e)
        if e.reason == "too_large":  # answered with another length than announced
            self._reject_body(source, "too_large")
            return False
        if source == origin and e.reason in ("not_held", "timeout"):
            peers = self.ctx.peers
            if e.reason == "not_held" or (origin in peers.connected_peers()
                                          and not peers.is_relayed(origin)):
                self._reject_body(origin, "unserved_announce")  # announced it, did not serve
                self.pull_slots.unserved(origin)  # ... and loses its place (STALL_S)
            else:  # no connection but through a relay, or none (behind NAT): a slow or
                self.metrics.inc("payload_pull_misses")  # failed path is no offence
            return False
        # a relay may not hold it yet; busy or a broken connection is no offence
        self.metrics.inc("payload_pull_misses")
        return source != origin and e.reason in ("not_held", "busy")

    def _reject_body(self, peer: str, reason: str) -> None:
        self.metrics.reject(peer, reason)
        self.report(peer, reason=reason)


@dataclass
class _AnnouncerPulls:
    slots: asyncio.Semaphore
    users: int = 0  # pulls holding or waiting for one of `slots`
    # while unproven: one pull at a time
    unproven: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(1))


class PullSlots:
    """The node's `payload_fetch_parallel` pull slots, of which one announcer (a pull's
    first source) holds at most half (at least 1) at once: a stalling announcer that
    floods announces holds its share until its pulls time out, and another announcer's
    pull takes one of the others instead of waiting behind it. An announcer's pulls beyond
    its share wait in its own queue of at most `queued`; `claim` refuses more.

    Announcers whose last pull gave us a verified body are "proven" (`served`; a failed pull
    unproves them, `failed`). An unproven announcer holds one slot at a time, and all of
    them together at most half of the slots: many identities that announce and stall (new
    identities cost nothing) can no longer hold every slot, the announcers that served us
    keep the other half, and one stalling newcomer leaves room for another newcomer.

    An announcer that did not serve a pull of its own body (`unserved`) is "stalled": for
    STALL_S (doubling with each further unserved pull, up to STALL_MAX_S) no pull of its
    goes ahead (`stalled`; a pull of its that waited for a slot meanwhile gives its place
    up without taking one), so N stalling identities cost the unproven half one pull each,
    not one per announce, and a newcomer's first body waits behind at most their first
    pulls; each of those ends at its first-answer deadline (FIRST_ANSWER_S, 4 s), not its
    pull timeout (10 s). A served body ends it (`served`)."""

    PROVEN_MAX = 4096  # announcers remembered as proven (oldest forgotten first)
    STALLED_MAX = 4096  # stalled announcers remembered (oldest forgotten first)

    def __init__(self, total: int, queued: int = PULL_QUEUE_PER_ANNOUNCER):
        self.per_announcer = max(1, total // 2)
        self.queued = queued
        self._all = asyncio.Semaphore(total)
        self._unproven = asyncio.Semaphore(max(1, total // 2))
        self._announcers: dict[str, _AnnouncerPulls] = {}
        self._proven: OrderedDict[str, None] = OrderedDict()
        # announcer -> (monotonic time its stall ends, the stall's length)
        self._stalled: OrderedDict[str, tuple[float, float]] = OrderedDict()

    def pulls(self, announcer: str) -> int:
        """Pulls of `announcer` holding or waiting for a slot."""
        entry = self._announcers.get(announcer)
        return 0 if entry is None else entry.users

    def proven(self, announcer: str) -> bool:
        return announcer in self._proven

    def stalled(self, announcer: str) -> bool:
        """`announcer` did not serve a pull within the last stall: pull nothing of it."""
        entry = self._stalled.get(announcer)
        return entry is not None and time.monotonic() < entry[0]

    def unserved(self, announcer: str) -> None:
        """`announcer` did not serve a pull of its own body: it is stalled for STALL_S, or
        twice its last stall (up to STALL_MAX_S) if it had one."""
        last = self._stalled.pop(announcer, None)
        length = STALL_S if last is None else min(2 * last[1], STALL_MAX_S)
        self._stalled[announcer] = (time.monotonic() + length, length)
        while len(self._stalled) > self.STALLED_MAX:
            self._stalled.popitem(last=False)

    def served(self, announcer: str) -> None:
        """A pull of `announcer`'s payload gave a verified body."""
        self._stalled.pop(announcer, None)
        self._proven[announcer] = None
        self._proven.move_to_end(announcer)
        while len(self._proven) > self.PROVEN_MAX:
            self._proven.popitem(last=False)

    def failed(self, announcer: str) -> None:
        """A pull of `announcer`'s payload gave nothing usable."""
        self._proven.pop(announcer, None)

    def claim(self, announcer: str) -> contextlib.AbstractAsyncContextManager[bool] | None:
        """A context that holds one slot for a pull of `announcer`'s payload (waiting for
        it first), or None if `announcer` already has its share and a full queue. Enter
        it at once: the place in the queue is taken here. It gives False, holding no slot,
        if `announcer` was stalled while the pull waited: do not pull then."""
        entry = self._announcers.get(announcer)
        if entry is None:
            entry = _AnnouncerPulls(asyncio.Semaphore(self.per_announcer))
            self._announcers[announcer] = entry
        if entry.users >= self.per_announcer + self.queued:
            return None
        entry.users += 1
        return self._hold(announcer, entry)

    @contextlib.asynccontextmanager
    async def _hold(self, announcer: str, entry: _AnnouncerPulls) -> AsyncIterator[bool]:
        try:
            async with entry.slots, contextlib.AsyncExitStack() as held:
                # whether it needs the unproven share is decided once it is its turn
                sems = ((self._all,) if self.proven(announcer)
                        else (entry.unproven, self._unproven, self._all))
                for sem in sems:
                    if self.stalled(announcer):
                        break
                    await held.enter_async_context(sem)
                go = not self.stalled(announcer)
                if not go:
                    await held.aclose()  # its slots to the next pull at once
                yield go
        finally:
            entry.users -= 1
            if entry.users == 0:
                del self._announcers[announcer]
