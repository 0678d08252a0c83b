"""Patch: a peer pruned from an over-full mesh in the heartbeat is backed off here too.

py-libp2p 0.8.1's heartbeat prunes a mesh above D_high (`mesh_heartbeat`) without recording
a backoff for the pruned peers, while the pruned peer records one (`handle_prune`: the
default 60 s) and the time of the PRUNE. The next heartbeat that finds the mesh below D_low
may then pick the peer it has just pruned and GRAFT it; the pruned peer takes that GRAFT,
seconds after the PRUNE, for a GRAFT flood ("GRAFT flood detected ... applying penalty"),
answers with another PRUNE and backs us off for a minute. The mesh flaps and both sides end
up refusing each other. go-libp2p-pubsub adds the backoff on its side of every PRUNE it
sends. Here `mesh_heartbeat` is wrapped per router: each peer it prunes is backed off for
`prune_back_off`, as the pruned side does."""

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
