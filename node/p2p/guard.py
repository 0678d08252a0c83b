"""Our thin layer over py-libp2p's weak spots (trio side), pinned to the version it patches.

py-libp2p 0.8.1 lets an exception raised in any stream handler end the whole host: its
pubsub reader catches only its own ParseError, so `03 ff ff ff` on /meshsub/1.1.0 (a
protobuf DecodeError) killed the libp2p thread. Here:
- every stream handler (py-libp2p's own and ours, installed before or after) is wrapped:
  an exception is caught, counted, the stream reset and the peer penalised;
- pubsub's `push_msg` gets a per-peer, per-topic rate limit BEFORE the signature check,
  the topic validators and local delivery (py-libp2p limits only when forwarding), and
  the same catch-count-penalise guard;
- the signed peer record py-libp2p handles on every pubsub RPC is memoised (CPU per message);
- a peer's subscriptions survive the loss of our pubsub stream to it while it stays connected;
- a subscription made while a new peer's pubsub stream is being set up reaches that peer.
"""

from __future__ import annotations

import contextvars
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable

import libp2p
import libp2p.pubsub.gossipsub as gossipsub_mod
import libp2p.pubsub.pubsub as pubsub_mod
from libp2p.exceptions import ParseError
from libp2p.io.exceptions import IncompleteReadError, MessageTooLarge
from libp2p.utils.varint import decode_uvarint

from .penalties import PeerPenalties, TopicRateLimiter
from .streams import remote_peer, reset_quietly

log = logging.getLogger(__name__)

# The py-libp2p release whose internals (multiselect.handlers, Pubsub.push_msg, the yamux
# stream buffers) this module and yamux.py were written and tested against.
PINNED_LIBP2P = "0.8.1"

FaultHook = Callable[[str, str, BaseException], None]


def check_libp2p_version(version: str | None = None) -> bool:
    """True if the installed py-libp2p is the pinned one; else one loud warning."""
    version = libp2p.__version__ if version is None else version
    if version == PINNED_LIBP2P:
        return True
    log.warning("py-libp2p %s is installed but swarm-node's transport guards were written "
                "for %s: stream-handler, rate-limit and yamux-window protections may not "
                "apply. Install libp2p==%s.", version, PINNED_LIBP2P, PINNED_LIBP2P)
    return False


def guarded(protocol_id: str, handler, on_fault: FaultHook):
    """Wrap one libp2p stream handler so that no exception leaves it."""
    if getattr(handler, "_swarm_guarded", False):
        return handler

    async def guard(stream) -> None:
        try:
            await handler(stream)
        except Exception as e:  # noqa: BLE001 - any bytes must not end the host: counted
            try:
                peer = remote_peer(stream)
            except Exception:  # noqa: BLE001 - a stream without a peer: nobody to blame
                peer = "?"
            on_fault(peer, protocol_id, e)
            await reset_quietly(stream)

    guard._swarm_guarded = True
    return guard


class GuardedHandlers(dict):
    """Replaces `host.multiselect.handlers`: each handler is wrapped as it is stored."""

    def __init__(self, initial: dict, on_fault: FaultHook):
        super().__init__()
        self.on_fault = on_fault
        for pid, handler in initial.items():
            self[pid] = handler

    def __setitem__(self, protocol_id, handler) -> None:
        if handler is not None:
            handler = guarded(str(protocol_id), handler, self.on_fault)
        super().__setitem__(protocol_id, handler)


def guard_stream_handlers(host, on_fault: FaultHook) -> None:
    mux = host.get_mux()
    mux.handlers = GuardedHandlers(mux.handlers, on_fault)


def guard_pubsub(pubsub, on_fault: FaultHook) -> None:
    """Guard `pubsub.push_msg` (one task per received message): an exception in it is
    counted and penalised instead of ending the pubsub service. Our own publishes (which
    py-libp2p also passes through push_msg) skip its signature check: we just signed them."""
    inner: Callable[..., Awaitable[None]] = pubsub.push_msg
    self_id = pubsub.my_id

    async def push_msg(forwarder, msg) -> None:
        token = _OWN_PUBLISH.set(forwarder == self_id and msg.from_id == self_id.to_bytes())
        try:
            await inner(forwarder, msg)
        except Exception as e:  # noqa: BLE001 - one message must not end pubsub: counted
            on_fault(forwarder.to_base58(), "pubsub.push_msg", e)
        finally:
            _OWN_PUBLISH.reset(token)

    push_msg._swarm_guarded = True
    pubsub.push_msg = push_msg


def keep_subscriptions_while_connected(pubsub) -> None:
    """py-libp2p 0.8.1 forgets every subscription of a peer whenever OUR pubsub stream to it
    fails (`Pubsub._handle_dead_peer`, e.g. a write on a connection that just closed), then
    re-opens that stream because the peer is still connected. But the peer announces its
    subscriptions only once, on ITS stream to us, which lives on and is never re-sent when
    another connection carries it. With two connections between a pair (both dialled at
    once) and one of them closing, the pair ended up peered in one direction only: one side
    saw no subscriber and sent nothing, for good. Here the subscriptions are kept while a
    connection to the peer remains (go-libp2p forgets them only once the peer disconnects);
    py-libp2p then re-opens our stream and replays its recent messages to the peer, which
    also re-sends the message whose write failed."""
    forget_and_retry = pubsub._handle_dead_peer

    def handle_dead_peer(peer_id) -> None:
        topics = [t for t, peers in pubsub.peer_topics.items() if peer_id in peers]
        count = pubsub._peer_subscription_count.get(peer_id)
        forget_and_retry(peer_id)
        if not topics or not pubsub._peer_is_connected(peer_id):
            return
        for t in topics:
            pubsub.peer_topics.setdefault(t, set()).add(peer_id)
        if count is not None:
            pubsub._peer_subscription_count[peer_id] = count

    pubsub._handle_dead_peer = handle_dead_peer


def announce_subscriptions_made_during_setup(pubsub) -> None:
    """py-libp2p 0.8.1 (and upstream as of 2026-08) registers a new peer in three steps:
    open the pubsub stream, write the hello (our subscriptions as they are at that moment),
    then add the peer to `Pubsub.peers`. A subscribe (or unsubscribe) that runs between the
    hello and the registration, e.g. while the stream write waits, is announced to
    `Pubsub.peers` only, so the new peer never hears of it: it never counts us as a
    subscriber, sends us nothing it publishes (its messages wait for our subscription in
    the router's pending queue for good) and may still accept our GRAFT, a one-sided mesh.
    This is how a node restarted with the same key lost its first message in
    test_restart_with_same_key_rejoins: the test subscribes the moment the connection
    appears. Here, once the registration is done, a change of our topics since it began
    is announced to that peer (each announce with py-libp2p's own retry on a full queue);
    nothing extra is sent when the topics did not change."""
    register = pubsub._handle_new_peer

    async def handle_new_peer(peer_id) -> None:
        before = None if peer_id in pubsub.peers else frozenset(pubsub.topic_ids)
        await register(peer_id)
        queue = pubsub.peer_queues.get(peer_id)
        if before is None or queue is None:
            return  # was registered already, or the registration failed
        now = frozenset(pubsub.topic_ids)
        changes = [(t, True) for t in sorted(now - before)]
        changes += [(t, False) for t in sorted(before - now)]
        for topic, subscribe in changes:
            rpc, subopt = pubsub._build_announce_rpc(topic, subscribe)
            pubsub._enqueue_or_retry_announce(peer_id, queue, rpc, subopt)

    pubsub._handle_new_peer = handle_new_peer


def leave_dialing_to_discovery(host) -> None:
    """py-libp2p 0.8.1's AutoConnector dials every peerstore peer that is not connected
    (every 10 s while under 50 connections, i.e. always in a swarm of our size, and after
    each disconnect), beside discovery.py: a peer then gets two connections dialled at once
    (the pair's later close is what lost pubsub peering, see above), and a peer that our
    penalties cut is dialled again at once. discovery.py owns dialing (target_peers,
    backoff, refusals), so the AutoConnector is switched off."""

    async def no_auto_connect() -> None:
        return None

    host.get_network().auto_connector.maybe_connect = no_auto_connect


def limit_before_spawn(pubsub, self_id, limiter: TopicRateLimiter, penalties: PeerPenalties,
                       metrics) -> None:
    """Apply the per-peer, per-topic rate limit where pubsub's reader spawns the task for
    a received message (`manager.run_task(push_msg, forwarder, msg)`): a flood is dropped
    before any task, signature check, decode or validation is spent on it. Call once the
    pubsub service runs (its manager exists then)."""
    manager = pubsub.manager
    run_task = manager.run_task

    def admit(forwarder, msg) -> bool:
        if forwarder == self_id:
            return True
        metrics.inc("gossip_copies_in")  # every copy received, duplicates included
        fwd = forwarder.to_base58()
        for t in msg.topicIDs:
            if not limiter.allow(fwd, t):
                metrics.reject(fwd, "rate_limited")
                penalties.penalise(fwd, "rate_limited")
                return False
        return True

    def limited_run_task(fn, *args, **kwargs):
        if getattr(fn, "_swarm_guarded", False) and len(args) == 2:
            if not admit(*args):
                return None
            # A copy of a message already validated: push_msg would return at its own
            # seen check; dropping it here saves the task (most copies are duplicates:
            # every peer receives each message from several mesh peers).
            if pubsub._is_msg_seen(args[1]):
                metrics.inc("gossip_duplicates")
                return None
        return run_task(fn, *args, **kwargs)

    manager.run_task = limited_run_task


# Per-RPC signed-peer-record work (CPU per message per hop) ---------------------------------
# py-libp2p 0.8.1 attaches the sender's signed peer record to every pubsub RPC and, on every
# RPC received, parses it, verifies its Ed25519 signature and rewrites the peerstore entry;
# on every RPC sent it lists the host's addresses (getsockname per listener) and re-marshals
# the cached record. Both are memoised here: a record already accepted byte for byte from
# that peer is not verified again for RECORD_MEMO_S, and the outgoing record is rebuilt at
# most every RECORD_MEMO_S (py-libp2p re-issues it if the addresses changed meanwhile).
# The memos live on the host object: keyed by id(host) in a module dict (as before), a new
# host that got a closed host's id sent that host's record for up to RECORD_MEMO_S, and its
# peers, seeing a record of another peer, dropped every RPC of it (subscriptions included).
RECORD_MEMO_S = 60.0
_MAX_MEMO = 4096


def install_record_memo() -> None:
    """Patch py-libp2p's pubsub modules once per process (idempotent)."""
    for mod in (pubsub_mod, gossipsub_mod):
        if getattr(mod.maybe_consume_signed_record, "_swarm_memo", False):
            continue
        mod.maybe_consume_signed_record = _memo_consume(mod.maybe_consume_signed_record)
        mod.env_to_send_in_RPC = _memo_outgoing(mod.env_to_send_in_RPC)


def _memo_consume(inner):
    def consume(msg, host, peer_id) -> bool:
        if not msg.HasField("senderRecord"):
            return True
        consumed: dict[tuple[bytes, bytes], float] | None = getattr(host, "_swarm_consumed",
                                                                   None)
        if consumed is None:
            consumed = host._swarm_consumed = {}
        key = (peer_id.to_bytes(), msg.senderRecord)
        now = time.monotonic()
        if consumed.get(key, 0.0) > now:
            return True
        ok = inner(msg, host, peer_id)
        if ok:
            if len(consumed) >= _MAX_MEMO:
                consumed.clear()
            consumed[key] = now + RECORD_MEMO_S
        return ok

    consume._swarm_memo = True
    return consume


def _memo_outgoing(inner):
    def outgoing(host) -> tuple[bytes, bool]:
        now = time.monotonic()
        hit = getattr(host, "_swarm_outgoing", None)
        if hit is not None and hit[0] > now:
            return hit[1][0], False
        value = inner(host)
        host._swarm_outgoing = (now + RECORD_MEMO_S, value)
        return value

    outgoing._swarm_memo = True
    return outgoing


# CPU per gossip message: py-libp2p 0.8.1 work that scales badly ------------------------------
# - Pubsub.publish runs our own message through push_msg, which verifies the Ed25519 signature
#   we have just made (a pass over the whole payload). Skipped for our own publishes only
#   (guard_pubsub marks them); every received message is still verified.
# - Its ValidationCache keeps LRU order in a list: every put scans and shifts up to
#   `validation_cache_size` (4096) entries. Same behaviour here with an OrderedDict.
# - The pubsub reader takes each RPC's varint length one byte per stream read, then the body
#   in frame-sized reads; each read goes through three locks and the yamux window logic.
#   Here one read takes whatever the stream holds (bounded: up to the current RPC's size or
#   READ_CHUNK past it), and RPCs are cut from a per-stream buffer.
_OWN_PUBLISH: contextvars.ContextVar[bool] = contextvars.ContextVar("own_publish",
                                                                    default=False)
READ_CHUNK = 64 * 1024


def install_pubsub_fast_paths() -> None:
    """Patch py-libp2p's pubsub module once per process (idempotent)."""
    if getattr(pubsub_mod.signature_validator, "_swarm_fast", False):
        return
    pubsub_mod.signature_validator = _skip_own(pubsub_mod.signature_validator)
    pubsub_mod.read_varint_prefixed_bytes_limited = read_rpc


def _skip_own(verify):
    def signature_validator(msg) -> bool:
        return True if _OWN_PUBLISH.get() else verify(msg)

    signature_validator._swarm_fast = True
    return signature_validator


class ValidationCache:
    """Drop-in for py-libp2p's pubsub ValidationCache with O(1) operations."""

    def __init__(self, ttl: float, max_size: int):
        self.ttl = ttl
        self.max_size = max_size
        self.cache: OrderedDict[bytes, object] = OrderedDict()

    def get(self, msg_id: bytes):
        result = self.cache.get(msg_id)
        if result is None:
            return None
        if time.time() - result.timestamp > self.ttl:
            del self.cache[msg_id]
            return None
        self.cache.move_to_end(msg_id)
        return result

    def put(self, msg_id: bytes, result) -> None:
        self.cache[msg_id] = result
        self.cache.move_to_end(msg_id)
        while len(self.cache) > self.max_size:
            self.cache.popitem(last=False)

    def _remove(self, msg_id: bytes) -> None:
        self.cache.pop(msg_id, None)

    def clear_expired(self) -> None:
        cutoff = time.time() - self.ttl
        for msg_id in [k for k, r in self.cache.items() if r.timestamp < cutoff]:
            del self.cache[msg_id]


def use_fast_validation_cache(pubsub) -> None:
    old = pubsub.validation_cache
    pubsub.validation_cache = ValidationCache(old.ttl, old.max_size)


async def read_rpc(stream, max_length: int) -> bytes:
    """`read_varint_prefixed_bytes_limited` over a per-stream buffer (same errors: ParseError,
    MessageTooLarge before the body is read, IncompleteReadError at a short end)."""
    buf: bytearray | None = getattr(stream, "_swarm_rbuf", None)
    if buf is None:
        buf = stream._swarm_rbuf = bytearray()
    while True:
        length, header = _parse_length(buf, max_length)
        if length is not None and len(buf) >= header + length:
            rpc = bytes(buf[header:header + length])
            del buf[:header + length]
            return rpc
        want = READ_CHUNK if length is None else header + length - len(buf)
        chunk = await stream.read(max(want, READ_CHUNK) if length is None else want)
        if not chunk:
            raise IncompleteReadError(f"stream ended {len(buf)} bytes into an RPC",
                                      expected_bytes=header + (length or 1),
                                      received_bytes=len(buf))
        buf += chunk


def _parse_length(buf: bytearray, max_length: int) -> tuple[int | None, int]:
    """(RPC length, varint size), or (None, 0) while the varint is incomplete."""
    for i in range(min(len(buf), 10)):
        if buf[i] & 0x80 == 0:
            length = decode_uvarint(bytes(buf[:i + 1]))
            if length > max_length:
                raise MessageTooLarge(f"Message length {length} exceeds maximum allowed "
                                      f"{max_length}")
            return length, i + 1
    if len(buf) >= 10:
        raise ParseError("Varint decoding error: integer exceeds maximum size of 64 bits")
    return None, 0
