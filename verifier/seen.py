"""What a verifier has already accepted: rollout ids and (sender, round) pairs, on disk.

Replays must fail after a restart too, so both live in one SQLite file (WAL, one row per
id). Every row carries the policy version it belongs to; `prune(min_version)` deletes rows
of versions the verifier rejects as stale anyway, which bounds the file by
(staleness window) x (rollouts per version). `max_rows` is a hard cap on top: the oldest
versions go first. `path=None` keeps the same tables in memory (tests, benchmarks).

A used round also keeps the digest of the batch accepted for it, so the same batch seen
again (a gossip re-delivery or a third party's replay after the verifier restarted) is told
apart from a different batch for the same round: the first is a harmless duplicate of work
already accepted, only the second is a sender choosing among its draws.

A full disk is a `DiskFull` (node/diskspace.py), never a crash: SQLite rolls a failed
commit back itself ("database or disk is full"), so nothing is rolled back twice, and the
caller pauses and retries the same call once space returns (it changes nothing until its
commit succeeds).
"""

from __future__ import annotations

import hashlib
import sqlite3
import threading
from pathlib import Path

from ..node.diskspace import DiskFull

_SCHEMA = """
CREATE TABLE IF NOT EXISTS seen (id BLOB PRIMARY KEY, version INTEGER NOT NULL);
CREATE INDEX IF NOT EXISTS seen_version ON seen(version);
CREATE TABLE IF NOT EXISTS rounds (sender TEXT NOT NULL, round INTEGER NOT NULL,
                                   version INTEGER NOT NULL, PRIMARY KEY (sender, round));
CREATE INDEX IF NOT EXISTS rounds_version ON rounds(version);
"""

# Versions past the stale limit for which used rounds (one small row per accepted batch) are
# still remembered: longer than any re-delivery or envelope-window replay lags behind.
ROUND_MEMORY = 64


def batch_digest(ids: list[bytes]) -> bytes:
    """The identity of one batch: BLAKE2b-128 over its rollout ids, in order."""
    h = hashlib.blake2b(digest_size=16, person=b"swarm-batch1")
    for i in ids:
        h.update(bytes(i))
    return h.digest()


def _full(e: sqlite3.Error) -> bool:
    return isinstance(e, sqlite3.OperationalError) and "full" in str(e)


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
        columns = {row[1] for row in self._db.execute("PRAGMA table_info(rounds)")}
        if "digest" not in columns:  # a file from before batch digests: rows keep NULL
            self._db.execute("ALTER TABLE rounds ADD COLUMN digest BLOB")
        self._lock = threading.Lock()
        self._min_version = 0

    # queries -----------------------------------------------------------------------------

    def seen(self, rollout_id: bytes) -> bool:
        with self._lock:
            return self._db.execute("SELECT 1 FROM seen WHERE id = ?",
                                    (rollout_id,)).fetchone() is not None

    def round_used(self, sender: str, round_: int) -> bool:
        return self.round_digest(sender, round_) is not None

    def round_digest(self, sender: str, round_: int) -> bytes | None:
        """None when (sender, round) is unused; else the digest of the batch accepted for it
        (b"" for a round recorded before digests were kept)."""
        with self._lock:
            row = self._db.execute("SELECT digest FROM rounds WHERE sender = ? AND round = ?",
                                   (sender, round_)).fetchone()
        return None if row is None else bytes(row[0] or b"")

    def counts(self) -> tuple[int, int]:
        with self._lock:
            return (self._db.execute("SELECT COUNT(*) FROM seen").fetchone()[0],
                    self._db.execute("SELECT COUNT(*) FROM rounds").fetchone()[0])

    # updates -----------------------------------------------------------------------------

    def _write(self, statements) -> None:
        """Run `statements(db)` in one transaction; a full disk raises DiskFull with nothing
        changed (SQLite has rolled the transaction back already when it says "full")."""
        with self._lock:
            try:
                self._db.execute("BEGIN")
                statements(self._db)
                self._db.execute("COMMIT")
            except sqlite3.Error as e:
                if self._db.in_transaction:
                    try:
                        self._db.execute("ROLLBACK")
                    except sqlite3.Error:
                        pass  # rolled back by SQLite already; the original error matters
                if _full(e):
                    raise DiskFull(f"{self.path}: {e}", path=self.path or "") from e
                raise

    def add(self, ids: list[bytes], version: int, sender: str | None = None,
            round_: int | None = None, digest: bytes | None = None) -> None:
        """Remember `ids` (and the round with its batch digest, when given) in one
        transaction."""
        def run(db):
            db.executemany("INSERT OR IGNORE INTO seen VALUES (?, ?)",
                           [(bytes(i), int(version)) for i in ids])
            if sender is not None and round_ is not None:
                db.execute("INSERT OR IGNORE INTO rounds(sender, round, version, digest) "
                           "VALUES (?, ?, ?, ?)", (sender, int(round_), int(version), digest))
            self._cap(db)
        self._write(run)

    def prune(self, min_version: int) -> None:
        """Forget the rollout ids of versions < `min_version` (no longer verifiable anyway),
        and the used rounds ROUND_MEMORY versions later: a batch of a version that has just
        turned stale, seen again (re-delivered, replayed after a restart), is still told
        apart as already accepted instead of judged stale against its honest sender."""
        if min_version <= self._min_version:
            return

        def run(db):
            db.execute("DELETE FROM seen WHERE version < ?", (min_version,))
            db.execute("DELETE FROM rounds WHERE version < ?", (min_version - ROUND_MEMORY,))
        self._write(run)
        self._min_version = min_version

    def _cap(self, db) -> None:
        n = db.execute("SELECT COUNT(*) FROM seen").fetchone()[0]
        if n <= self.max_rows:
            return
        # drop the oldest version still present (replays of it are near the stale limit)
        oldest = db.execute("SELECT MIN(version) FROM seen").fetchone()[0]
        db.execute("DELETE FROM seen WHERE version = ?", (oldest,))

    def close(self) -> None:
        with self._lock:
            self._db.close()
