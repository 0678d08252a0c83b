"""Patch: pubsub's validation cache with O(1) operations.

py-libp2p 0.8.1's `ValidationCache` keeps its LRU order in a list: every `put` and every
hit scans and shifts up to `validation_cache_size` (4096 here) entries (`list.remove`,
`list.pop(0)`), for every message received. The replacement (per pubsub, same interface and
semantics) keeps the order in an OrderedDict."""

from __future__ import annotations

import time
from collections import OrderedDict

from libp2p.pubsub.pubsub import Pubsub
from libp2p.pubsub.pubsub import ValidationCache as UpstreamValidationCache

from .registry import Patch, has_signature, register, sets_attribute

PATCH = register(Patch(
    name="o1_validation_cache",
    scope="pubsub",
    targets=("libp2p.pubsub.pubsub:Pubsub.validation_cache",),
    why="each put and hit of the validation cache scans a list of up to 4096 ids",
    upstream="none filed (searched 2026-09)",
    shape=lambda: (sets_attribute(Pubsub, "validation_cache")
                   + has_signature(UpstreamValidationCache, "get", ("self", "msg_id"))
                   + has_signature(UpstreamValidationCache, "put",
                                   ("self", "msg_id", "result"))),
    fingerprints={"libp2p.pubsub.pubsub:ValidationCache": "73fa652b9b0dc7c9"},
))


class ValidationCache:
    """Drop-in for py-libp2p's pubsub ValidationCache."""

    def __init__(self, ttl: float, max_size: int):
        self.ttl = ttl
        self.max_size = max_size
        self.cache: OrderedDict[bytes, object] = OrderedDict()

    def get(self, msg_id: bytes):
        result = self.cache.get(msg_id)
        if result is None:
            return None
        if time.time() - result.timestamp > self.ttl:
            del self.cache[msg_id]
            return None
        self.cache.move_to_end(msg_id)
        return result

    def put(self, msg_id: bytes, result) -> None:
        self.cache[msg_id] = result
        self.cache.move_to_end(msg_id)
        while len(self.cache) > self.max_size:
            self.cache.popitem(last=False)

    def _remove(self, msg_id: bytes) -> None:
        self.cache.pop(msg_id, None)

    def clear_expired(self) -> None:
        cutoff = time.time() - self.ttl
        for msg_id in [k for k, r in self.cache.items() if r.timestamp < cutoff]:
            del self.cache[msg_id]


def patch_validation_cache(pubsub) -> None:
    old = pubsub.validation_cache
    if not isinstance(old, ValidationCache):
        pubsub.validation_cache = ValidationCache(old.ttl, old.max_size)
