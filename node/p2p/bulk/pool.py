"""Idle connections or streams per peer, reused for the next request."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar


class Poolable(Protocol):
    idle_since: float

    def discard(self) -> None: ...


S = TypeVar("S", bound=Poolable)


class IdlePool(dict[str, list[S]], Generic[S]):
    """Idle streams per peer (last in, first out), at most `per_peer` each. A stream is
    handed out again only while idle for less than `max_idle_s` and `usable`; any other is
    closed (`discard`). Used for bulk-plane connections and for libp2p shard streams."""

    MAX_PEERS = 4096  # bounded, however many peers come and go

    def __init__(self, per_peer: int, max_idle_s: float):
        super().__init__()
        self.per_peer, self.max_idle_s = per_peer, max_idle_s

    def take(self, peer: str, usable: Callable[[S], bool] = lambda _: True) -> S | None:
        pool = self.get(peer)
        while pool:
            stream = pool.pop()
            if time.monotonic() - stream.idle_since < self.max_idle_s and usable(stream):
                return stream
            stream.discard()
        return None

    def put(self, peer: str, stream: S, keep: bool = True) -> None:
        if peer not in self:
            while len(self) >= self.MAX_PEERS:
                self.drop(next(iter(self)))
        pool = self.setdefault(peer, [])
        if keep and len(pool) < self.per_peer:
            stream.idle_since = time.monotonic()
            pool.append(stream)
        else:
            stream.discard()

    def drop(self, peer: str) -> None:
        for stream in self.pop(peer, []):
            stream.discard()

    def drop_all(self) -> None:
        for peer in list(self):
            self.drop(peer)
