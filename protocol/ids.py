"""Protocol IDs and gossip topic names. Every one carries a version.

NODE_SPEC.md lists the same IDs in a table; tests/protocol/test_spec_ids.py keeps the two equal.
"""

# Stream protocols (libp2p protocol IDs).
FETCH_PROTOCOL = "/swarm-node/fetch/1.0.0"  # payload pull after a PayloadAnnounce
SHARD_PROTOCOL = "/swarm-node/shard/1.0.0"  # checkpoint shard download
# Request: a ShardRequest naming policy and version; response: the trainer's signed manifest
# envelope bytes, re-checked by the asker.
MANIFEST_PROTOCOL = "/swarm-node/manifest/1.0.0"
PEERS_PROTOCOL = "/swarm-node/peers/1.0.0"  # peer exchange (Hello in, peer list out)
# Where the bulk plane (TLS beside libp2p: shards, gossip bodies) listens: empty request,
# answer msgpack [host, port] (host "": the IP of this libp2p connection) or [] for none.
BULK_PROTOCOL = "/swarm-node/bulk/1.0.0"
# Request: empty; response: the trainers the answering node follows (a trainer: itself).
FOLLOWS_PROTOCOL = "/swarm-node/follows/1.0.0"
# Reachability: "dial me back at my observed IP on these ports" (DialbackRequest/Result).
DIALBACK_PROTOCOL = "/swarm-node/dialback/1.0.0"

STREAM_PROTOCOLS = (FETCH_PROTOCOL, SHARD_PROTOCOL, MANIFEST_PROTOCOL, PEERS_PROTOCOL,
                    BULK_PROTOCOL, FOLLOWS_PROTOCOL, DIALBACK_PROTOCOL)

TOPIC_KINDS = ("rollouts", "checkpoints", "verdicts", "adverts")


def topic(swarm_id: str, kind: str) -> str:
    """Gossip topic for `kind` in swarm `swarm_id`, e.g. /swarm-node/demo/rollouts/1."""
    if kind not in TOPIC_KINDS:
        raise ValueError(f"unknown topic kind {kind!r}; expected one of {TOPIC_KINDS}")
    return f"/swarm-node/{swarm_id}/{kind}/1"
