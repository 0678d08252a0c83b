"""What a received gossip message must pass before pubsub spends a task on it (called from
the libp2p thread by patches/spawn_gate.py, before the signature check and validation)."""

from __future__ import annotations

from .penalties import PeerPenalties, TopicRateLimiter


class Admission:
    """Per-forwarder, per-topic rate limit on every copy received; copies of messages
    already validated are dropped (counted `gossip_duplicates`)."""

    def __init__(self, limiter: TopicRateLimiter, penalties: PeerPenalties, metrics):
        self.limiter = limiter
        self.penalties = penalties
        self.metrics = metrics

    def admit(self, forwarder, msg, duplicate: bool) -> bool:
        self.metrics.inc("gossip_copies_in")  # every copy received, duplicates included
        fwd = forwarder.to_base58()
        for t in msg.topicIDs:
            if not self.limiter.allow(fwd, t):
                self.metrics.reject(fwd, "rate_limited")
                self.penalties.penalise(fwd, "rate_limited")
                return False
        if duplicate:
            self.metrics.inc("gossip_duplicates")
            return False
        return True
