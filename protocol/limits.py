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
