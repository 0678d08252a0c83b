"""What a verifier has already accepted: rollout ids and (sender, round) pairs, on disk.

Replays must fail after a restart too, so both live in one SQLite file (WAL, one row per
id). Every row carries the policy version it belongs to; `prune(min_version)` deletes rows
of versions the verifier rejects as stale anyway, which bounds the file by
(staleness window) x (rollouts per version). `max_rows` is a hard cap on top: the oldest
versions go first. `path=None` keeps the same tables in memory (tests, benchmarks).
"""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path

_SCHEMA = """
CREATE TABLE IF NOT EXISTS seen (id BLOB PRIMARY KEY, version INTEGER NOT NULL);
CREATE INDEX IF NOT EXISTS seen_version ON seen(version);
CREATE TABLE IF NOT EXISTS rounds (sender TEXT NOT NULL, round INTEGER NOT NULL,
                                   version INTEGER NOT NULL, PRIMARY KEY (sender, round));
CREATE INDEX IF NOT EXISTS rounds_version ON rounds(version);
"""


class SeenStore:
    """Accepted rollout ids and used rounds of one policy, persisted and pruned by version."""

    def __init__(self, path: str | Path | None = None, *, max_rows: int = 2_000_000):
        self.path = Path(path) if path is not None else None
        self.max_rows = max_rows
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(str(self.path) if self.path else ":memory:",
                                   check_same_thread=False, isolation_level=None)
        if self.path is not None:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)
        self._lock = threading.Lock()
        self._min_version = 0

    # queries -----------------------------------------------------------------------------

    def seen(self, rollout_id: bytes) -> bool:
        with self._lock:
            return self._db.execute("SELECT 1 FROM seen WHERE id = ?",
                                    (rollout_id,)).fetchone() is not None

    def round_used(self, sender: str, round_: int) -> bool:
        with self._lock:
            return self._db.execute("SELECT 1 FROM rounds WHERE sender = ? AND round = ?",
                                    (sender, round_)).fetchone() is not None

    def counts(self) -> tuple[int, int]:
        with self._lock:
            return (self._db.execute("SELECT COUNT(*) FROM seen").fetchone()[0],
                    self._db.execute("SELECT COUNT(*) FROM rounds").fetchone()[0])

    # updates -----------------------------------------------------------------------------

    def add(self, ids: list[bytes], version: int, sender: str | None = None,
            round_: int | None = None) -> None:
        """Remember `ids` (and the round, when given) in one transaction."""
        with self._lock:
            self._db.execute("BEGIN")
            try:
                self._db.executemany("INSERT OR IGNORE INTO seen VALUES (?, ?)",
                                     [(bytes(i), int(version)) for i in ids])
                if sender is not None and round_ is not None:
                    self._db.execute("INSERT OR IGNORE INTO rounds VALUES (?, ?, ?)",
                                     (sender, int(round_), int(version)))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._cap()

    def prune(self, min_version: int) -> None:
        """Forget everything of versions < `min_version` (no longer verifiable anyway)."""
        if min_version <= self._min_version:
            return
        with self._lock:
            self._db.execute("DELETE FROM seen WHERE version < ?", (min_version,))
            self._db.execute("DELETE FROM rounds WHERE version < ?", (min_version,))
            self._min_version = min_version

    def _cap(self) -> None:
        n = self._db.execute("SELECT COUNT(*) FROM seen").fetchone()[0]
        if n <= self.max_rows:
            return
        # drop the oldest version still present (replays of it are near the stale limit)
        oldest = self._db.execute("SELECT MIN(version) FROM seen").fetchone()[0]
        self._db.execute("DELETE FROM seen WHERE version = ?", (oldest,))

    def close(self) -> None:
        with self._lock:
            self._db.close()
