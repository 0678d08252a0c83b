"""What this node knows about each (policy, version), in one record with a lifecycle.

A record holds everything the broadcaster keeps per version besides the bytes on disk: who
advertised it and what they hold, which of them were admitted as sources, the source book
of a download in flight, what was last advertised, whether its manifest was refused. It is
created when the version is first seen (a manifest or an advert) and dropped

- when the store removes the version (pruned, deleted, quarantined: `ShardStore.on_removed`),
- for a version not on disk, as soon as a newer version of its policy is complete here (it
  will never be fetched), and
- beyond `MAX_VERSIONS_TRACKED` versions per policy that are not on disk (the oldest first;
  advertisers can name versions that never come, and keys cost them nothing).

So what a node keeps per version is bounded by the store's retention plus
`MAX_VERSIONS_TRACKED` per followed policy, whatever number of versions it sees.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from .sources import SourceBook
from .store import ShardStore

MAX_VERSIONS_TRACKED = 16
"""Versions per policy, not on disk, whose advertisers are remembered."""

Key = tuple[str, int]


@dataclass(eq=False)
class VersionRecord:
    policy_id: str
    version: int
    holders: dict[str, set[int] | None] = field(default_factory=dict)  # admitted sources
    hosts: dict[str, str] = field(default_factory=dict)  # admitted peer -> endpoint host
    unproven: set[str] = field(default_factory=set)  # admitted peers not proven then
    book: SourceBook | None = None  # the sources of the download in flight
    advertised: int = 0  # shards held at this node's last advert of the version
    dirty: bool = False  # to be advertised at the next advert round
    refused: bool = False  # its manifest was refused for its settings: not pulled again

    @property
    def key(self) -> Key:
        return self.policy_id, self.version

    def remember(self, peer: str, holdings: set[int] | None) -> None:
        """`peer` (admitted) holds `holdings` (None: all) of this version."""
        known = self.holders.get(peer, set())
        if peer in self.holders and known is not None and holdings is not None:
            known |= holdings
        else:
            self.holders[peer] = None if holdings is None else set(holdings)
        if self.book is not None:
            self.book.add(peer, holdings)


class VersionRecords:
    """The records of one node, bound to its store's lifecycle."""

    def __init__(self, store: ShardStore, max_tracked: int = MAX_VERSIONS_TRACKED):
        self.store = store
        self.max_tracked = max_tracked
        self._records: dict[Key, VersionRecord] = {}
        store.on_removed.append(self.drop)

    def get(self, key: Key) -> VersionRecord | None:
        return self._records.get(key)

    def track(self, key: Key) -> VersionRecord | None:
        """The record of `key`, created if new; None for a version this node will never
        fetch (not on disk, and not newer than the newest complete version here)."""
        rec = self._records.get(key)
        if rec is not None:
            return rec
        if key not in self.store.entries and key[1] <= self.store.current_version(key[0]):
            return None
        rec = self._records[key] = VersionRecord(*key)
        self._bound(key[0])
        return rec

    def drop(self, key: Key) -> None:
        self._records.pop(key, None)

    def settle(self, policy_id: str) -> None:
        """After a version of `policy_id` completed or the store pruned it: drop the
        records of versions not on disk that are not newer than the newest complete."""
        current = self.store.current_version(policy_id)
        for key in [k for k in self._records if k[0] == policy_id
                    and k not in self.store.entries and k[1] <= current]:
            del self._records[key]

    def _bound(self, policy_id: str) -> None:
        loose = sorted((r for r in self._records.values() if r.policy_id == policy_id
                        and r.key not in self.store.entries and r.book is None),
                       key=lambda r: r.version)
        for rec in loose[:max(0, len(loose) - self.max_tracked)]:
            del self._records[rec.key]

    def __iter__(self) -> Iterator[VersionRecord]:
        return iter(list(self._records.values()))

    def __len__(self) -> int:
        return len(self._records)
