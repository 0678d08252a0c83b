"""Patches: a peer's subscriptions are not forgotten while it stays connected, and a
subscription made while a new peer's pubsub stream is being set up reaches that peer."""

from __future__ import annotations

from libp2p.pubsub.pubsub import Pubsub

from .registry import Patch, has_attr, has_signature, register

KEEP = register(Patch(
    name="keep_subscriptions_while_connected",
    scope="pubsub",
    targets=("libp2p.pubsub.pubsub:Pubsub._handle_dead_peer",),
    why="a failed write on one of two connections forgets the peer's subscriptions for "
        "good while it stays connected: one-way peering, messages never sent",
    upstream="py-libp2p #1403 / PR #1407 (merged 2026-07: disconnect hygiene; the "
             "subscriptions are still dropped on an outbound failure); go-libp2p-pubsub "
             "forgets them only once the peer disconnects",
    shape=lambda: (has_signature(Pubsub, "_handle_dead_peer", ("self", "peer_id"),
                                 coroutine=False)
                   + has_signature(Pubsub, "_peer_is_connected", ("self", "peer_id"))
                   + has_attr(Pubsub, "_handle_dead_peer")),
))
ANNOUNCE = register(Patch(
    name="announce_subscriptions_made_during_setup",
    scope="pubsub",
    targets=("libp2p.pubsub.pubsub:Pubsub._handle_new_peer",),
    why="a subscribe between a new peer's hello and its registration is never announced "
        "to that peer: it never sends us the topic's messages",
    upstream="none filed for py-libp2p (searched 2026-09); the same race was fixed in "
             "nim-libp2p PR #809",
    shape=lambda: (has_signature(Pubsub, "_handle_new_peer", ("self", "peer_id"),
                                 coroutine=True)
                   + has_signature(Pubsub, "_build_announce_rpc",
                                   ("self", "topic_id", "subscribe"))
                   + has_signature(Pubsub, "_enqueue_or_retry_announce",
                                   ("self", "peer_id", "queue", "rpc_msg", "announce"))),
))


def patch_keep_subscriptions(pubsub) -> None:
    """py-libp2p 0.8.1 forgets every subscription of a peer whenever OUR pubsub stream to it
    fails (`Pubsub._handle_dead_peer`, e.g. a write on a connection that just closed), then
    re-opens that stream because the peer is still connected. But the peer announces its
    subscriptions only once, on ITS stream to us, which lives on and is never re-sent when
    another connection carries it. With two connections between a pair (both dialled at
    once) and one of them closing, the pair ended up peered in one direction only: one side
    saw no subscriber and sent nothing, for good. Here the subscriptions are kept while a
    connection to the peer remains; py-libp2p then re-opens our stream and replays its
    recent messages to the peer, which also re-sends the message whose write failed."""
    forget_and_retry = pubsub._handle_dead_peer
    if getattr(forget_and_retry, "_swarm_patched", False):
        return

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

    handle_dead_peer._swarm_patched = True
    pubsub._handle_dead_peer = handle_dead_peer


def patch_announce_during_setup(pubsub) -> None:
    """py-libp2p 0.8.1 (and upstream as of 2026-08) registers a new peer in three steps:
    open the pubsub stream, write the hello (our subscriptions as they are at that moment),
    then add the peer to `Pubsub.peers`. A subscribe (or unsubscribe) that runs between the
    hello and the registration, e.g. while the stream write waits, is announced to
    `Pubsub.peers` only, so the new peer never hears of it: it never counts us as a
    subscriber, sends us nothing it publishes and may still accept our GRAFT, a one-sided
    mesh (a node restarted with the same key lost its first message this way). Here, once
    the registration is done, a change of our topics since it began is announced to that
    peer (with py-libp2p's own retry on a full queue); nothing extra is sent otherwise."""
    register_peer = pubsub._handle_new_peer
    if getattr(register_peer, "_swarm_patched", False):
        return

    async def handle_new_peer(peer_id) -> None:
        before = None if peer_id in pubsub.peers else frozenset(pubsub.topic_ids)
        await register_peer(peer_id)
        queue = pubsub.peer_queues.get(peer_id)
        if before is None or queue is None:
            return  # was registered already, or the registration failed
        now = frozenset(pubsub.topic_ids)
        changes = [(t, True) for t in sorted(now - before)]
        changes += [(t, False) for t in sorted(before - now)]
        for topic, subscribe in changes:
            rpc, subopt = pubsub._build_announce_rpc(topic, subscribe)
            pubsub._enqueue_or_retry_announce(peer_id, queue, rpc, subopt)

    handle_new_peer._swarm_patched = True
    pubsub._handle_new_peer = handle_new_peer
