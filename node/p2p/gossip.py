"""GossipSub set up so that nothing is dropped silently, and the topic validator (trio side).

py-libp2p 0.8.1's defaults drop messages: 10 messages/s/topic/peer spam limit, 32-slot
outbound queue per peer, 1 MiB RPC cap, 32-slot subscription channel. Here: the spam limit
is raised to `p2p.max_messages_per_second`; the outbound queues and the subscription channel
are enlarged and every remaining drop is counted (patches/send_queues.py,
patches/subscription_channel.py); `publish` waits for queue capacity (pubsub.py).
"""

from __future__ import annotations

import functools
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable

from libp2p.peer.id import ID
from libp2p.pubsub.gossipsub import PROTOCOL_ID, PROTOCOL_ID_V11, GossipSub
from libp2p.pubsub.pubsub import Pubsub

from ...protocol.envelope import Envelope, ReplayCache, open_envelope
from ...protocol.errors import ProtocolError
from ...protocol.limits import ANNOUNCE_TYPE, TOPIC_MESSAGE_TYPES, Limits
from . import patches
from .metrics import P2PMetrics
from .patches.send_queues import ACCEPTED_INLINE_MAX, RPC_OVERHEAD

log = logging.getLogger(__name__)



def build_gossip(host, cfg, metrics: P2PMetrics,
                 on_fault: patches.FaultHook) -> tuple[GossipSub, Pubsub]:
    """GossipSub router + Pubsub for `host` from the `p2p` config section, patched
    (patches.patch_pubsub; `on_fault` hears of an exception while handling a message)."""
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
        # py-libp2p's "adaptive gossip" rewrites the configured parameters every 30 s from
        # a health score that connection churn (our trims) and meshes below D pull down:
        # below 0.7 it sets the heartbeat to at least 30 s (meant to be "more frequent"
        # than its 120 s default), which stalls IHAVE gossip, mesh repair and the message
        # cache's window, and it raises D_low up to D_high + 2. The configured values hold.
        adaptive_gossip_enabled=False,
    )
    pubsub = Pubsub(
        host, router,
        cache_size=4096,
        strict_signing=True,
        validation_cache_size=4096,
        max_inbound_rpc_size=max_rpc_size(cfg),
    )
    patches.patch_pubsub(pubsub, router, on_fault=on_fault, metrics=metrics,
                         queues=patches.QueueLimits(cfg.outbound_queue, max_rpc_size(cfg),
                                                    max_queued_bytes(cfg)),
                         flood_publish_own=cfg.flood_publish)
    return router, pubsub


@functools.lru_cache(maxsize=4096)
def origin_b58(from_id: bytes) -> str:
    """The base58 peer id of a pubsub message's `from` bytes, memoised: every received copy
    needs it (validator, reader), and `ID(...).to_base58()` re-encodes each time."""
    return ID(from_id).to_base58()


def max_rpc_size(cfg) -> int:
    return max(cfg.inline_payload_max, ACCEPTED_INLINE_MAX) + RPC_OVERHEAD


def max_queued_bytes(cfg) -> int:
    """Bytes one peer's outbound queue may hold: its slots full of messages of our own inline
    size (64 MiB by default). Without it, a peer forwarding 256 KiB inline messages (which we
    accept) to a peer that does not read could park outbound_queue x 272 KiB (~0.5 GiB) per
    slow peer here; honest traffic (inline <= inline_payload_max) fills the slots first."""
    return cfg.outbound_queue * (cfg.inline_payload_max + RPC_OVERHEAD)


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


# Rejects that every honest relay's validator makes too, whatever its version or config:
# a peer that forwards such a message did not validate it, so the forwarder is charged.
# Any other reject (a size or type another version accepts, a stale clock) is the origin's.
RELAY_FAULTS = frozenset({"malformed", "bad_schema", "bad_signature", "bad_peer_id",
                          "sender_mismatch"})


class GossipValidator:
    """Topic validator: the peer filter, then `open_envelope` (size, schema, signature,
    sender = pubsub origin, skew, replay), then the topic <-> type rule, then the origin's
    rate (`admission.accept`). Rejects are counted per charged peer and reason and reported
    to `on_reject(peer, reason)` (the penalties): the forwarder for RELAY_FAULTS, the origin
    otherwise. Accepted envelopes are kept until delivery so they are decoded once."""

    def __init__(self, self_id: str, limits: Limits, metrics: P2PMetrics,
                 peer_filter: Callable[[], Callable[[str], bool] | None],
                 max_skew_s: float, on_reject: Callable[[str, str], object] | None = None,
                 admission=None):
        self.self_id = self_id
        self.limits = limits
        self.metrics = metrics
        self.peer_filter = peer_filter
        self.max_skew_s = max_skew_s
        self.on_reject = on_reject
        self.admission = admission
        self.replay = SharedReplayCache(window_s=2 * max_skew_s)  # the whole skew window
        self.accepted: OrderedDict[bytes, Envelope] = OrderedDict()
        self.carried_by: OrderedDict[str, str] = OrderedDict()  # origin -> forwarding peer
        self.max_pending = 65536

    def for_kind(self, kind: str) -> Callable[[ID, object], bool]:
        """The validator of topic `kind`: only its message types pass."""
        allowed = TOPIC_MESSAGE_TYPES.get(kind, frozenset())
        return lambda forwarder, msg: self.validate(allowed, forwarder, msg, kind)

    def _reject(self, fwd: str, origin: str, reason: str) -> bool:
        charged = fwd if reason in RELAY_FAULTS or fwd == origin else origin
        self.metrics.reject(charged, reason)
        if self.on_reject is not None:
            self.on_reject(charged, reason)
        return False

    def validate(self, allowed: frozenset[str], forwarder: ID, msg, kind: str = "") -> bool:
        fwd = forwarder.to_base58()
        try:
            origin = origin_b58(msg.from_id)
        except Exception:  # noqa: BLE001 - unparseable origin
            return self._reject(fwd, fwd, "bad_peer_id")
        if origin == self.self_id:
            return True  # our own publish, sealed by us
        allow = self.peer_filter()
        if allow is not None and (not allow(fwd) or not allow(origin)):
            self.metrics.reject(origin if allow(fwd) else fwd, "banned")
            return False
        try:
            env = open_envelope(msg.data, limits=self.limits, expected_sender=origin,
                                replay_cache=self.replay, max_skew_s=self.max_skew_s)
        except ProtocolError as e:
            log.info("rejected gossip from %s (origin %s): %s", fwd, origin, e)
            return self._reject(fwd, origin, e.reason)
        except Exception as e:  # noqa: BLE001 - a decoder bug must not kill the host
            log.warning("validator error on message from %s: %s: %s", fwd, type(e).__name__, e)
            self.metrics.reject(origin, "internal_error")  # our bug: nobody is charged
            return False
        inner = env.message.inner_type if env.type == ANNOUNCE_TYPE else env.type
        if inner not in allowed:
            log.info("rejected a %s envelope from %s (origin %s) on a topic for %s", inner,
                     fwd, origin, "/".join(sorted(allowed)) or "nothing")
            return self._reject(fwd, origin, "wrong_topic")
        if self.admission is not None and not self.admission.accept(origin, kind):
            return False  # over the origin's rate: counted and charged to the origin
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
