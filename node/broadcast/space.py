"""Disk space reserved for the downloads in flight.

Checking that a version fits the free disk is not enough when several download at once:
two versions that each fit, accepted together, both run into the margin and both stall
(seen: two followed trainers, 22 MiB into a 256 MiB margin). So a download reserves the
bytes it still has to write when its manifest is accepted, the reservation shrinks as its
shards are written, and is released when it ends (complete, failed, superseded). A
manifest is accepted only if its missing bytes fit beside every other reservation with the
margin (`node.min_free_disk_mib`) to spare; each shard write is checked the same way.
"""

from __future__ import annotations

from pathlib import Path

from ..diskspace import ensure_free

Key = tuple[str, int]


class SpaceReservations:
    def __init__(self, root: Path):
        self.root = Path(root)
        self._held: dict[Key, int] = {}

    def others(self, key: Key, *, except_policy: bool = False) -> int:
        """Bytes reserved by downloads other than `key` (`except_policy`: other than any
        version of key's policy, which `key` supersedes)."""
        return sum(n for k, n in self._held.items()
                   if k != key and not (except_policy and k[0] == key[0]))

    def check(self, key: Key, need: int) -> None:
        """Raise DiskFull unless `need` bytes for `key` fit beside the other
        reservations of other policies (a newer version supersedes its own policy's)."""
        ensure_free(self.root, need + self.others(key, except_policy=True))

    def reserve(self, key: Key, need: int) -> None:
        """Hold `need` bytes for `key` (checked first by `check`)."""
        self._held[key] = max(0, need)

    def check_write(self, key: Key, size: int) -> None:
        """Raise DiskFull unless a write of `size` bytes for `key` fits beside the other
        downloads' reservations."""
        ensure_free(self.root, size + self.others(key))

    def written(self, key: Key, nbytes: int) -> None:
        if key in self._held:
            self._held[key] = max(0, self._held[key] - nbytes)

    def release(self, key: Key) -> None:
        self._held.pop(key, None)

    @property
    def total(self) -> int:
        return sum(self._held.values())
