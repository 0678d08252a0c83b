"""Crash-safe on-disk rollout buffer (SQLite, WAL journal, synchronous=FULL).

Life of a group (one task's completions):
  add()      -> row committed (fsync'd) before add() returns: only then is it acknowledged;
  claim()    -> marked as used by training step s (still on disk);
  release_through(s) after checkpoint s is durable -> rows claimed by steps <= s deleted;
  recover(s) at start-up with the last durable checkpoint s -> rows claimed by steps <= s
             deleted (crash between checkpoint and delete), rows claimed by steps > s
             returned to pending (those steps were lost with the crash).
So a SIGKILL at any point loses no acknowledged group and trains on none twice. A row's
`key` is a content hash: the same group delivered twice is stored once. A group verified
from a peer keeps its sender, so the intake can take back what a later alarm condemns
(`drop_sender`: its unclaimed groups).
"""

from __future__ import annotations

import hashlib
import sqlite3
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

from ..diskspace import DiskFull, ensure_free

SCHEMA = """
CREATE TABLE IF NOT EXISTS groups (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    key BLOB NOT NULL UNIQUE,
    source TEXT NOT NULL,
    policy_version INTEGER NOT NULL,
    received_version INTEGER NOT NULL,
    payload BLOB NOT NULL,
    claimed_step INTEGER
);
CREATE INDEX IF NOT EXISTS groups_pending ON groups(claimed_step, source);
CREATE TABLE IF NOT EXISTS counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
"""


@dataclass
class CompletionRecord:
    completion_ids: list[int]
    reward: float
    logprobs: list[float] | None = None  # behaviour logprobs; None: recompute at training
    finish_reason: str = "length"
    text: str = ""


@dataclass
class RolloutGroup:
    """All completions of one task from one policy: the unit of GRPO and of the buffer."""

    source: str                 # "local" or "external"
    task: dict[str, Any]        # TaskRef wire dict
    prompt_ids: list[int]
    completions: list[CompletionRecord]
    policy_id: str = ""
    policy_version: int = 0     # version that sampled it (local) / the sender's (external)
    received_version: int = 0   # this trainer's version when the group was accepted
    temperature: float = 1.0
    sender: str = ""            # the peer whose verified batch it came from ("" for own)
    # versions this trainer moved on while the group's batch waited in its verification
    # queue (own policy's batches; trainer.py: not counted as staleness)
    queued: int = 0
    id: int | None = field(default=None, compare=False)

    @property
    def rewards(self) -> list[float]:
        return [c.reward for c in self.completions]

    def to_bytes(self) -> bytes:
        comps = []
        for c in self.completions:
            lp = None if c.logprobs is None else np.asarray(c.logprobs, "<f4").tobytes()
            comps.append([c.completion_ids, float(c.reward), lp, c.finish_reason, c.text])
        return msgpack.packb({
            "source": self.source, "task": self.task, "prompt_ids": self.prompt_ids,
            "completions": comps, "policy_id": self.policy_id,
            "policy_version": self.policy_version, "received_version": self.received_version,
            "temperature": self.temperature, "sender": self.sender, "queued": self.queued,
        }, use_bin_type=True)

    @classmethod
    def from_bytes(cls, data: bytes, row_id: int | None = None) -> RolloutGroup:
        d = msgpack.unpackb(data, raw=False, strict_map_key=True)
        comps = [CompletionRecord(list(ids), float(r),
                                  None if lp is None else np.frombuffer(lp, "<f4").tolist(),
                                  fr, text)
                 for ids, r, lp, fr, text in d["completions"]]
        return cls(d["source"], d["task"], list(d["prompt_ids"]), comps, d["policy_id"],
                   d["policy_version"], d["received_version"], d["temperature"],
                   str(d.get("sender", "")), int(d.get("queued", 0)), id=row_id)

    def key(self) -> bytes:
        """Content hash (ignores received_version, queued, the local reward and the sender)."""
        h = hashlib.sha256()
        h.update(msgpack.packb([self.source, self.task, self.policy_id, self.policy_version,
                                self.prompt_ids,
                                [c.completion_ids for c in self.completions]],
                               use_bin_type=True))
        return h.digest()


class RolloutBuffer:
    """Thread-safe; one writer process (the trainer) per file."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(str(self.path), check_same_thread=False,
                                   isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")  # fsync on every commit
        self._db.executescript(SCHEMA)
        columns = {row[1] for row in self._db.execute("PRAGMA table_info(groups)")}
        if "sender" not in columns:  # a buffer from before senders were kept
            self._db.execute("ALTER TABLE groups ADD COLUMN sender TEXT NOT NULL DEFAULT ''")

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _tx(self, fn):
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                out = fn(self._db)
                self._db.execute("COMMIT")
            except BaseException as e:
                if self._db.in_transaction:
                    self._db.execute("ROLLBACK")
                if isinstance(e, sqlite3.OperationalError) and "full" in str(e):
                    raise DiskFull(f"{self.path}: {e}", path=self.path) from e  # diskspace.py
                raise
            return out

    def add(self, groups: Iterable[RolloutGroup]) -> list[int]:
        """Store groups durably; returns the new row ids (duplicates are skipped)."""
        groups = list(groups)
        ensure_free(self.path.parent, sum(len(g.to_bytes()) for g in groups))  # else DiskFull

        def run(db):
            ids = []
            for g in groups:
                cur = db.execute(
                    "INSERT OR IGNORE INTO groups(key, source, policy_version, "
                    "received_version, payload, sender) VALUES (?,?,?,?,?,?)",
                    (g.key(), g.source, g.policy_version, g.received_version, g.to_bytes(),
                     g.sender))
                if cur.rowcount:
                    g.id = cur.lastrowid
                    ids.append(cur.lastrowid)
                else:
                    _bump(db, "duplicates", 1)
            return ids
        return self._tx(run)

    def pending(self, source: str | None = None) -> list[RolloutGroup]:
        """Unclaimed groups, oldest first."""
        q = "SELECT id, payload FROM groups WHERE claimed_step IS NULL"
        args: tuple = ()
        if source is not None:
            q += " AND source = ?"
            args = (source,)
        with self._lock:
            rows = self._db.execute(q + " ORDER BY id", args).fetchall()
        return [RolloutGroup.from_bytes(p, i) for i, p in rows]

    def count(self, source: str | None = None, claimed: bool = False) -> int:
        q = "SELECT COUNT(*) FROM groups WHERE claimed_step IS " + ("NOT NULL" if claimed else "NULL")
        args: tuple = ()
        if source is not None:
            q += " AND source = ?"
            args = (source,)
        with self._lock:
            return self._db.execute(q, args).fetchone()[0]

    def claim(self, ids: Iterable[int], step: int) -> None:
        ids = list(ids)
        self._tx(lambda db: db.executemany(
            "UPDATE groups SET claimed_step = ? WHERE id = ? AND claimed_step IS NULL",
            [(step, i) for i in ids]))

    def drop(self, ids: Iterable[int], reason: str) -> None:
        """Delete unused groups for a counted reason (stale, zero_advantage, ...)."""
        ids = list(ids)

        def run(db):
            n = 0
            for i in ids:
                n += db.execute("DELETE FROM groups WHERE id = ?", (i,)).rowcount
            _bump(db, f"dropped_{reason}", n)
        if ids:
            self._tx(run)

    def drop_sender(self, sender: str, reason: str = "condemned") -> int:
        """Delete `sender`'s unclaimed groups (counted `dropped_<reason>`); returns how many.
        Groups a step already claimed stay: that step is running or done."""
        def run(db):
            n = db.execute("DELETE FROM groups WHERE sender = ? AND claimed_step IS NULL",
                           (sender,)).rowcount
            _bump(db, f"dropped_{reason}", n)
            return n
        return self._tx(run) if sender else 0

    def unclaim(self, step: int) -> int:
        """A step that failed (out of memory): its groups are pending again."""
        return self._tx(lambda db: db.execute(
            "UPDATE groups SET claimed_step = NULL WHERE claimed_step = ?", (step,)).rowcount)

    def release_through(self, step: int) -> int:
        """Checkpoint `step` is durable: delete the groups its steps used."""
        def run(db):
            n = db.execute("DELETE FROM groups WHERE claimed_step IS NOT NULL AND "
                           "claimed_step <= ?", (step,)).rowcount
            _bump(db, "trained", n)
            return n
        return self._tx(run)

    def recover(self, checkpointed_step: int) -> tuple[int, int]:
        """At start-up: (released, returned) groups, given the last durable checkpoint."""
        def run(db):
            released = db.execute("DELETE FROM groups WHERE claimed_step IS NOT NULL AND "
                                  "claimed_step <= ?", (checkpointed_step,)).rowcount
            _bump(db, "trained", released)
            returned = db.execute("UPDATE groups SET claimed_step = NULL WHERE "
                                  "claimed_step > ?", (checkpointed_step,)).rowcount
            return released, returned
        return self._tx(run)

    def bump(self, name: str, n: int = 1) -> None:
        """Add n to a persistent counter."""
        self._tx(lambda db: _bump(db, name, n))

    def counters(self) -> dict[str, int]:
        with self._lock:
            return dict(self._db.execute("SELECT name, value FROM counters").fetchall())


def _bump(db, name: str, n: int) -> None:
    if n:
        db.execute("INSERT INTO counters(name, value) VALUES (?, ?) ON CONFLICT(name) "
                   "DO UPDATE SET value = value + excluded.value", (name, n))
