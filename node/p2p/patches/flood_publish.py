"""Patch: GossipSub v1.1 flood publishing (go-libp2p's default; py-libp2p 0.8.1 lacks it).

A message we originate goes to every subscribed GossipSub peer, not only our mesh, so every
directly connected subscriber gets it in one hop. Forwarded messages still go to the mesh
only. Publishes are small (payloads above `inline_payload_max` are announced and pulled),
so the few extra sends cost little, and the mesh degree no longer sets the first hop. The
router's `_get_peers_to_send` is replaced per router (`p2p.flood_publish`)."""

from __future__ import annotations

from libp2p.pubsub.gossipsub import PROTOCOL_ID, PROTOCOL_ID_V11, GossipSub

from .registry import Patch, has_signature, register, sets_attribute

PATCH = register(Patch(
    name="flood_publish",
    scope="router",
    targets=("libp2p.pubsub.gossipsub:GossipSub._get_peers_to_send",),
    why="own publishes go to the mesh only (GossipSub v1.1 flood publishing is missing)",
    upstream="none for gossipsub flood publishing in py-libp2p (searched 2026-09; #941 and "
             "PR #939 are about FloodSub); gossipsub v1.1 spec, 'Flood Publishing'",
    shape=lambda: (has_signature(GossipSub, "_get_peers_to_send",
                                 ("self", "topic_ids", "msg_forwarder", "origin", "msg_id"))
                   + sets_attribute(GossipSub, "peer_protocol")),
))


def patch_flood_publish(router: GossipSub, self_id) -> None:
    inner = router._get_peers_to_send
    if getattr(inner, "_swarm_flood", False):
        return

    def peers_to_send(topic_ids, msg_forwarder, origin, msg_id: bytes | None = None):
        peers = set(inner(topic_ids, msg_forwarder=msg_forwarder, origin=origin,
                          msg_id=msg_id))
        if msg_forwarder == self_id and origin == self_id and router.pubsub is not None:
            for t in topic_ids:
                peers.update(p for p in router.pubsub.peer_topics.get(t, ())
                             if router.peer_protocol.get(p) in (PROTOCOL_ID, PROTOCOL_ID_V11))
            peers.discard(self_id)
        return peers

    peers_to_send._swarm_flood = True
    router._get_peers_to_send = peers_to_send
