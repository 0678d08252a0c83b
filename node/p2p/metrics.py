"""Counters of the peer-to-peer layer. Incremented from both threads (single dict
operations under the GIL); read with `snapshot()`."""

from __future__ import annotations

from collections import Counter


class P2PMetrics:
    """Named counters plus gossip rejects per (sender, reason).

    Counter names (NODE_SPEC.md lists them): published, publish_waits, publish_stalled_queues,
    publish_no_peers, publish_no_mesh, received, delivered, own_skipped, rejected,
    drop_outbound_queue_full, drop_outbound_oversized, drop_subscription_full,
    drop_handler_queue_full, handler_errors,
    payload_announced, payload_fetched, payload_fetch_failed, payload_pulled_bulk,
    payload_pulled_libp2p, payload_pull_misses, payload_bulk_* (bodies.py),
    payload_push_*, payload_pushed (gossip_push.py),
    bulk_* (the bulk plane: node/p2p/bulk),
    gossip_copies_in, gossip_duplicates, gossip_queue_dropped (admission.py), requests_sent,
    requests_failed,
    requests_served, requests_busy, requests_too_large, streams_refused, dials, dial_failures,
    stream_faults, window_violations, peers_cut, connections_refused,
    connections_refused_subnet (hostile peers). Rejects are counted per charged peer: the
    origin of a gossip message, its forwarder only for relay faults (gossip.RELAY_FAULTS).
    """

    def __init__(self) -> None:
        self.counters: Counter[str] = Counter()
        self.rejects: Counter[tuple[str, str]] = Counter()

    def inc(self, name: str, n: int = 1) -> None:
        self.counters[name] += n

    def reject(self, sender: str, reason: str) -> None:
        self.rejects[(sender, reason)] += 1
        self.counters["rejected"] += 1
        self.counters[f"rejected.{reason}"] += 1

    def __getitem__(self, name: str) -> int:
        return self.counters.get(name, 0)

    def snapshot(self) -> dict:
        return {
            "counters": dict(self.counters),
            "rejects": [{"sender": s, "reason": r, "count": n}
                        for (s, r), n in list(self.rejects.items())],
        }
