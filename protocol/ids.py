"""Protocol IDs and gossip topic names. Every one carries a version."""

FETCH_PROTOCOL = "/swarm-node/fetch/1.0.0"
SHARD_PROTOCOL = "/swarm-node/shard/1.0.0"
HELLO_PROTOCOL = "/swarm-node/hello/1.0.0"

TOPIC_KINDS = ("rollouts", "checkpoints", "verdicts", "adverts")


def topic(swarm_id: str, kind: str) -> str:
    """Gossip topic for `kind` in swarm `swarm_id`, e.g. /swarm-node/demo/rollouts/1."""
    if kind not in TOPIC_KINDS:
        raise ValueError(f"unknown topic kind {kind!r}; expected one of {TOPIC_KINDS}")
    return f"/swarm-node/{swarm_id}/{kind}/1"
