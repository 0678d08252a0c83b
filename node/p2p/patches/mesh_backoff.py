"""Patches on PRUNE backoff: a peer pruned from an over-full mesh in the heartbeat is backed
off here too, and a backoff keeps a peer out of the mesh only, not out of IHAVE gossip.

py-libp2p 0.8.1's heartbeat prunes a mesh above D_high (`mesh_heartbeat`) without recording
a backoff for the pruned peers, while the pruned peer records one (`handle_prune`: the
default 60 s) and the time of the PRUNE. The next heartbeat that finds the mesh below D_low
may then pick the peer it has just pruned and GRAFT it; the pruned peer takes that GRAFT,
seconds after the PRUNE, for a GRAFT flood ("GRAFT flood detected ... applying penalty"),
answers with another PRUNE and backs us off for a minute. The mesh flaps and both sides end
up refusing each other. go-libp2p-pubsub adds the backoff on its side of every PRUNE it
sends. Here `mesh_heartbeat` is wrapped per router: each peer it prunes is backed off for
`prune_back_off`, as the pruned side does.

py-libp2p 0.8.1 also leaves every peer in backoff out of IHAVE gossip (`gossip_heartbeat`
picks its targets through `_get_in_topic_gossipsub_peers_from_minus(..., backoff_check=True)`).
With both sides of each PRUNE backed off for a minute, a link that carried a PRUNE carries no
gossip either way for that minute. Under a connection bound (connmgr.py keeps mesh links and
trims the others) the non-mesh links left are mostly such pruned ones, and a mesh island (a
triangle at D_low, which grafts no more) linked to the rest only by them got none of 40
messages in 40 s (test_connmgr many_peers, 1 run in 6 to 16). The gossipsub v1.1 backoff
governs GRAFT only; go-libp2p-pubsub's emitGossip chooses IHAVE targets by mesh/fanout, direct peers
and score, never backoff. Here the IHAVE targets are chosen without the backoff check."""

from __future__ import annotations

from libp2p.pubsub.gossipsub import GossipSub

from .registry import Patch, has_signature, register

PATCH = register(Patch(
    name="heartbeat_prune_backoff",
    scope="router",
    targets=("libp2p.pubsub.gossipsub:GossipSub.mesh_heartbeat",),
    why="a heartbeat PRUNE records no backoff on the pruning side: the next heartbeat may "
        "GRAFT the peer just pruned, which takes it for a GRAFT flood and prunes back",
    upstream="none filed for py-libp2p (searched 2026-12; its main of 2026-08 still prunes "
             "without a local backoff); gossipsub v1.1 spec, 'PRUNE Backoff'; go-libp2p-"
             "pubsub's heartbeat calls addBackoff for each peer it prunes",
    shape=lambda: (has_signature(GossipSub, "mesh_heartbeat", ("self",), coroutine=False)
                   + has_signature(GossipSub, "_add_back_off",
                                   ("self", "peer", "topic", "is_unsubscribe",
                                    "backoff_duration"))),
))

GOSSIP = register(Patch(
    name="ihave_to_backed_off_peers",
    scope="router",
    targets=("libp2p.pubsub.gossipsub:GossipSub.gossip_heartbeat",),
    why="IHAVE gossip skips peers in PRUNE backoff: for a minute after a PRUNE the link "
        "carries no gossip, and a mesh island reached only over pruned links gets nothing",
    upstream="none filed for py-libp2p (searched 2026-12); gossipsub v1.1 spec, 'PRUNE "
             "Backoff' (GRAFT only); go-libp2p-pubsub's emitGossip does not check backoff",
    shape=lambda: (has_signature(GossipSub, "gossip_heartbeat", ("self",), coroutine=False)
                   + has_signature(GossipSub, "_get_in_topic_gossipsub_peers_from_minus",
                                   ("self", "topic", "num_to_select", "minus",
                                    "backoff_check"))),
))
SELECT = "_get_in_topic_gossipsub_peers_from_minus"


def patch_heartbeat_prune_backoff(router: GossipSub) -> None:
    inner = router.mesh_heartbeat
    if getattr(inner, "_swarm_backoff", False):
        return

    def mesh_heartbeat():
        to_graft, to_prune = inner()
        for peer, topics in to_prune.items():
            for topic in topics:
                router._add_back_off(peer, topic, False)
        return to_graft, to_prune

    mesh_heartbeat._swarm_backoff = True
    router.mesh_heartbeat = mesh_heartbeat


def patch_ihave_to_backed_off(router: GossipSub) -> None:
    """`gossip_heartbeat` (synchronous: nothing else runs in the router meanwhile) selects
    its IHAVE targets with the backoff check turned off; the router's other selections
    (mesh GRAFT candidates, fanout) keep it. Its own return is the gossip, as upstream."""
    inner = router.gossip_heartbeat
    if getattr(inner, "_swarm_patched", False):
        return
    select = getattr(router, SELECT)

    def select_ignoring_backoff(topic, num_to_select, minus, backoff_check=False):
        return select(topic, num_to_select, minus, False)

    def gossip_heartbeat():
        setattr(router, SELECT, select_ignoring_backoff)
        try:
            return inner()
        finally:
            setattr(router, SELECT, select)

    gossip_heartbeat._swarm_patched = True
    router.gossip_heartbeat = gossip_heartbeat
