"""Size limits per message type. Defaults are documented in NODE_SPEC.md; the node's config
(`limits` section) overrides them."""

from __future__ import annotations

from dataclasses import dataclass, field

KiB = 1024
MiB = 1024 * KiB

DEFAULT_MAX_BYTES: dict[str, int] = {
    "rollout_batch": 16 * MiB,
    "checkpoint_manifest": 4 * MiB,
    "shard_request": 1 * KiB,
    "shard_response": 1 * KiB,
    "shard_advert": 192 * KiB,
    "hello": 8 * KiB,
    "peer_refusal": 1 * KiB,
    "dialback_request": 1 * KiB,
    "dialback_result": 2 * KiB,
    "status": 4 * KiB,
    "verdict": 4 * KiB,
    "payload_announce": 1 * KiB,
}
# Envelope overhead on top of the payload: sender, nonce, timestamp, signature, framing.
ENVELOPE_OVERHEAD = 512
DEFAULT_MAX_UNKNOWN = 4 * KiB


@dataclass(frozen=True)
class Limits:
    """Per-type payload limits in bytes."""

    max_bytes: dict[str, int] = field(default_factory=lambda: dict(DEFAULT_MAX_BYTES))

    def max_for(self, msg_type: str) -> int:
        return self.max_bytes.get(msg_type, DEFAULT_MAX_UNKNOWN)

    def max_envelope(self) -> int:
        return max(self.max_bytes.values()) + ENVELOPE_OVERHEAD


# Which message types may travel on which gossip topic (NODE_SPEC §1.4 step 10, §3).
# A payload announcement is allowed where its `inner_type` is.
TOPIC_MESSAGE_TYPES: dict[str, frozenset[str]] = {
    "rollouts": frozenset({"rollout_batch"}),
    "checkpoints": frozenset({"checkpoint_manifest"}),
    "verdicts": frozenset({"verdict"}),
    "adverts": frozenset({"shard_advert"}),
}
ANNOUNCE_TYPE = "payload_announce"


@dataclass(frozen=True)
class TopicRate:
    """A token bucket's rate: `per_s` refill, `burst` capacity."""

    per_s: float
    burst: float


# Inbound gossip per origin and topic (NODE_SPEC 3.2): per (connection, origin) before any
# signature check or decode, and per origin across connections once the signatures proved
# it. Charged to the origin, never to a relay. Sized for one busy honest producer (the
# trainer publishes a verdict per batch it verifies).
DEFAULT_TOPIC_RATES: dict[str, TopicRate] = {
    "rollouts": TopicRate(per_s=50.0, burst=500.0),
    "checkpoints": TopicRate(per_s=2.0, burst=20.0),
    "verdicts": TopicRate(per_s=50.0, burst=500.0),
    "adverts": TopicRate(per_s=20.0, burst=100.0),
}
OTHER_TOPIC_RATE = TopicRate(per_s=10.0, burst=20.0)

# Yamux: most bytes a peer may have buffered at us on one stream / one connection. An
# honest sender never exceeds the receive window we granted (16 MiB at most); a peer that
# does is cut.
MAX_STREAM_BUFFER = 16 * MiB + 64 * KiB
MAX_CONN_BUFFER = 64 * MiB
