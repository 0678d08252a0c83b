"""On-disk shard store, one directory per (policy, version).

    <root>/<policy_id>/<version:012d>/
        manifest.env           the trainer's signed manifest envelope, as received
        partial/               the checkpoint's files, created sparse at their final sizes;
                               each shard is written in place at its offset
        verified.bin           bitmap of the shards whose BLAKE3 matched (bit i = shard i)
        checkpoint/            `partial/` renamed, once every shard and the whole hash
                               verified
        COMPLETE               marker written after `checkpoint/` is in place

Shards are streamed to disk with bounded memory (one chunk per transfer) straight into
their place in the checkpoint files, so completing a version costs one hashing pass and a
rename, no copy (two passes for an older node's manifest that names a whole-concatenation
hash: InOrderHash). A shard counts (is served, advertised, skipped on resume) only after its
hash matched; after a restart the store re-hashes every shard the bitmap claims and resumes
from those that still verify. Only verified bytes are ever served.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import shutil
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import blake3

from ...protocol.envelope import open_envelope
from ...protocol.errors import ProtocolError
from ...protocol.messages import CheckpointManifest, ShardAdvert
from ..diskspace import as_disk_full, is_disk_full
from .errors import BroadcastError, StoreError
from .manifest import READ_CHUNK, SHARD_LIST, AcceptedManifest, iter_range

log = logging.getLogger(__name__)

POLICY_DIR = re.compile(r"^[A-Za-z0-9]{1,128}$")
MANIFEST_FILE = "manifest.env"
VERIFIED_FILE = "verified.bin"
COMPLETE_FILE = "COMPLETE"
QUARANTINE_DIR = ".quarantine"


@dataclass
class VersionEntry:
    """One (policy, version) in the store: its manifest and which shards are verified."""

    manifest: CheckpointManifest
    envelope: bytes
    path: Path
    have: set[int] = field(default_factory=set)  # verified shards (mark() them)
    complete: bool = False
    bits: bytearray = field(default_factory=bytearray, repr=False)  # `have` as a bitmap

    @property
    def key(self) -> tuple[str, int]:
        return self.manifest.policy_id, self.manifest.version

    @property
    def checkpoint_dir(self) -> Path:
        return self.path / "checkpoint"

    @property
    def partial_dir(self) -> Path:
        return self.path / "partial"

    @property
    def bitmap_path(self) -> Path:
        return self.path / VERIFIED_FILE

    def file_spans(self, start: int, end: int) -> Iterator[tuple[str, int, int]]:
        """(file name, offset in file, length) pieces of checkpoint bytes [start, end)."""
        pos = 0
        for f in self.manifest.files:
            lo, hi = max(start, pos), min(end, pos + f.size)
            if lo < hi:
                yield f.name, lo - pos, hi - lo
            pos += f.size
            if pos >= end:
                break

    def mark(self, index: int) -> None:
        """Shard `index` verified (kept in `have` and in the bitmap, O(1))."""
        if not self.bits:
            self.bits = bytearray((self.manifest.num_shards + 7) // 8)
        self.have.add(index)
        self.bits[index // 8] |= 1 << (index % 8)

    def clear_shards(self) -> None:
        self.have.clear()
        self.bits = bytearray()

    def save_bitmap(self) -> None:
        tmp = self.path / (VERIFIED_FILE + ".tmp")
        tmp.write_bytes(self.bitmap())
        os.replace(tmp, self.bitmap_path)

    def shard_len(self, index: int) -> int:
        start, end = self.manifest.shard_range(index)
        return end - start

    def has(self, index: int) -> bool:
        return self.complete or index in self.have

    def verified_bytes(self) -> int:
        """Bytes of the shards verified here (all of them when complete)."""
        m = self.manifest
        if self.complete:
            return m.total_size
        last = m.num_shards - 1
        short = m.shard_size - self.shard_len(last) if last in self.have else 0
        return len(self.have) * m.shard_size - short

    def missing_count(self) -> int:
        return 0 if self.complete else self.manifest.num_shards - len(self.have)

    def bitmap(self) -> bytes:
        n = (self.manifest.num_shards + 7) // 8
        if self.complete:
            full = bytearray(b"\xff" * n)
            if self.manifest.num_shards % 8:
                full[-1] = (1 << (self.manifest.num_shards % 8)) - 1
            return bytes(full)
        return bytes(self.bits) if self.bits else bytes(n)

    def advert(self) -> ShardAdvert:
        return ShardAdvert(policy_id=self.manifest.policy_id, version=self.manifest.version,
                           complete=self.complete, have=b"" if self.complete else self.bitmap())


def advert_shards(advert: ShardAdvert, num_shards: int) -> set[int] | None:
    """Shard indices an advert claims (None: all of them)."""
    if advert.complete:
        return None
    return {i for i in range(min(num_shards, len(advert.have) * 8))
            if advert.have[i // 8] >> (i % 8) & 1}


class InOrderHash:
    """The whole-checkpoint BLAKE3, computed while shards arrive instead of after.

    BLAKE3 of the concatenation must see the bytes in order, so it is fed by whichever
    receiving thread writes at the frontier `pos`: its bytes go in as they arrive (no read
    back), after the bytes of its own shard that it wrote before the frontier reached it
    (read back from the page cache). When a shard's last byte went in, the shards after it
    that already verified are read back and hashed too. Bytes of a transfer not yet
    verified go in optimistically: if that shard then fails, the hash is void and
    `ShardStore.assemble` hashes everything again (correct, only slower). Profiled: the
    hash after the last shard was the tail of every download (256 MiB, 8 clients on 2
    cores: 2 of 7 s)."""

    def __init__(self, entry: VersionEntry):
        self.entry = entry
        self.h = blake3.blake3()
        self.pos = 0
        self.valid = True
        self.lock = threading.Lock()
        self.live = self.read_back = 0  # bytes hashed as they arrived / read back

    def offer(self, index: int, start: int, data) -> None:
        """Bytes [start, start+len(data)) of shard `index` were just written."""
        if not self.lock.acquire(blocking=False):
            return  # someone else is at the frontier; read back later
        try:
            shard_start = self.entry.manifest.shard_range(index)[0]
            if not self.valid or not shard_start <= self.pos <= start:
                return
            self._read_back(self.pos, start)
            self.h.update(data)
            self.live += len(data)
            self.pos = start + len(data)
            if self.pos == self.entry.manifest.shard_range(index)[1]:
                self._follow_verified(index + 1)
        except (OSError, BroadcastError):  # version pruned meanwhile: hashed again, or gone
            self.valid = False
        finally:
            self.lock.release()

    def _follow_verified(self, index: int) -> None:
        m = self.entry.manifest
        while index < m.num_shards and index in self.entry.have:
            start, end = m.shard_range(index)
            if self.pos != start:
                return
            self._read_back(start, end)
            index += 1

    def _read_back(self, start: int, end: int) -> None:
        for data in iter_range(self.entry.partial_dir, self.entry.manifest.files, start, end):
            self.h.update(data)
        self.read_back += end - start
        self.pos = end

    def can_follow(self) -> bool:
        """Whether verified shards wait at the frontier (a cheap check, no lock)."""
        m = self.entry.manifest
        return (self.valid and self.pos < m.total_size and self.pos % m.shard_size == 0
                and self.pos // m.shard_size in self.entry.have)

    def follow(self) -> None:
        """Hash the verified shards at the frontier (blocking: call it in a thread)."""
        if not self.lock.acquire(blocking=False):
            return
        try:
            if self.valid:
                self._follow_verified(self.pos // self.entry.manifest.shard_size)
        except (OSError, BroadcastError):
            self.valid = False
        finally:
            self.lock.release()

    def failed(self, index: int) -> None:
        """Shard `index` did not verify: if any of its bytes went in, the hash is void."""
        with self.lock:
            if self.pos > self.entry.manifest.shard_range(index)[0]:
                self.valid = False

    def finish(self) -> bytes | None:
        """The whole digest (every shard verified), or None if it must be recomputed."""
        with self.lock:
            if not self.valid:
                return None
            self._read_back(self.pos, self.entry.manifest.total_size)
            return self.h.digest()


class ShardWriter:
    """Streams one shard into its place in the partial checkpoint files, hashing as it
    goes; `commit` marks it verified only if the length and hash match.

    `write` runs in a receiving thread that may outlive a cancelled transfer; once `abort`
    returned, no byte of this writer reaches the files (a lock orders the two), so a shard
    taken back from a slow source and fetched again elsewhere is never overwritten by the
    first transfer's late bytes."""

    def __init__(self, entry: VersionEntry, index: int, whole: InOrderHash | None = None):
        self.entry, self.index, self.whole = entry, index, whole
        self.start, end = entry.manifest.shard_range(index)
        self.expected_len = end - self.start
        self._fds: dict[str, int] = {}
        self._h = blake3.blake3()
        self._lock = threading.Lock()
        self._aborted = False
        self.received = 0

    def _fd(self, name: str) -> int:
        fd = self._fds.get(name)
        if fd is None:
            try:
                fd = self._fds[name] = os.open(self.entry.partial_dir / name, os.O_WRONLY)
            except OSError as e:  # the version was pruned meanwhile
                raise StoreError(f"shard {self.index}: {e}") from e
        return fd

    def write(self, data: bytes) -> None:
        with self._lock:
            if self._aborted:
                raise StoreError(f"shard {self.index}: transfer abandoned", reason="aborted")
            self._write(data)

    def _write(self, data: bytes) -> None:
        if self.received + len(data) > self.expected_len:
            raise StoreError(f"shard {self.index}: more than {self.expected_len} bytes",
                             reason="too_long")
        self._h.update(data)
        pos = self.start + self.received
        view = memoryview(data)
        for name, offset, length in self.entry.file_spans(pos, pos + len(data)):
            try:
                _pwrite_all(self._fd(name), view[:length], offset)
            except OSError as e:
                if is_disk_full(e):  # the download pauses; the source is not at fault
                    raise as_disk_full(e, self.entry.partial_dir, length) from e
                raise StoreError(f"shard {self.index}: {e}") from e
            view = view[length:]
        if self.whole is not None:
            self.whole.offer(self.index, pos, data)
        self.received += len(data)

    def _close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def commit(self) -> bool:
        """True: verified (now served and kept across restarts). False: wrong hash or
        length, or aborted (another copy of the shard went in its place); the bytes stay
        unverified and will be overwritten by a re-fetch."""
        with self._lock:
            if self._aborted:
                return False
        self._close()
        if (self.received != self.expected_len
                or self._h.digest() != self.entry.manifest.shard_hashes[self.index]):
            return False
        if not self.entry.partial_dir.is_dir():
            raise StoreError(f"shard {self.index}: version removed meanwhile")
        self.entry.mark(self.index)
        try:
            self.entry.save_bitmap()
        except OSError as e:  # disk full: kept in memory, saved with the next shard
            if not is_disk_full(e):
                raise StoreError(f"shard {self.index}: cannot save the bitmap: {e}") from e
        return True

    def abort(self) -> None:
        with self._lock:
            self._aborted = True
            self._close()


class SpareShardWriter(ShardWriter):
    """A second copy of a shard already being written in place (the download's endgame):
    its bytes are held in memory and hashed as they arrive, and touch the checkpoint files
    only in `commit`, after they verified, once the first transfer's writer was aborted (no
    byte of it reaches the files after that). Two writers never write the same place at
    once: a verified stream could otherwise mark a shard whose bytes on disk are partly
    another, unverified, stream's. Memory: one shard per spare copy (few, by design)."""

    def __init__(self, entry: VersionEntry, index: int):
        super().__init__(entry, index, None)  # the whole hash reads it back once placed
        self._buf = bytearray()
        self._sealed = False

    def _write(self, data: bytes) -> None:
        if self._sealed:
            raise StoreError(f"shard {self.index}: transfer abandoned", reason="aborted")
        if self.received + len(data) > self.expected_len:
            raise StoreError(f"shard {self.index}: more than {self.expected_len} bytes",
                             reason="too_long")
        self._h.update(data)
        self._buf += data
        self.received += len(data)

    def commit(self, first: ShardWriter | None = None) -> bool:
        """True: verified and written in place (`first`, the other transfer of the shard, is
        aborted first). False: wrong hash or length, nothing written."""
        with self._lock:
            self._sealed = True  # no late byte after this
        if (self.received != self.expected_len
                or self._h.digest() != self.entry.manifest.shard_hashes[self.index]):
            self._buf = bytearray()
            return False
        if first is not None:
            first.abort()
        try:
            view = memoryview(self._buf)
            for name, offset, length in self.entry.file_spans(self.start, self.start
                                                               + self.expected_len):
                try:
                    _pwrite_all(self._fd(name), view[:length], offset)
                except OSError as e:
                    if is_disk_full(e):
                        raise as_disk_full(e, self.entry.partial_dir, length) from e
                    raise StoreError(f"shard {self.index}: {e}") from e
                view = view[length:]
        finally:
            self._close()
            self._buf = bytearray()
        return super().commit()


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    """All of `data` at `offset`, or OSError. `pwrite` may write less than asked without an
    error (a nearly full disk takes what fits): ignoring that left holes in shards whose
    hash had been checked on the received bytes, and a corrupt checkpoint was handed over."""
    while data:
        n = os.pwrite(fd, data, offset)
        if n <= 0:
            raise OSError(errno.ENOSPC, "no progress writing a shard")
        data, offset = data[n:], offset + n


def _hash_into(h, paths: list[Path], chunk: int = 8 * READ_CHUNK) -> None:
    """Feed the files' bytes to `h` through one reused buffer (not `update_mmap`: mapped
    pages count as the process's resident memory, 1 GiB for a 1 GiB checkpoint)."""
    buf = bytearray(chunk)
    view = memoryview(buf)
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(buf):
                h.update(view[:n])


class ShardStore:
    """All versions this node holds. Blocking file work: call the heavy methods (`load`,
    `open_version`, `add_checkpoint`, `assemble`) in a thread."""

    def __init__(self, root: Path, keep_versions: int = 3):
        self.root = Path(root)
        self.keep_versions = keep_versions
        self.entries: dict[tuple[str, int], VersionEntry] = {}
        # called with the key of each version that leaves the store (pruned, removed,
        # quarantined): what else is kept per version is dropped with it (records.py)
        self.on_removed: list[Callable[[tuple[str, int]], None]] = []
        self.root.mkdir(parents=True, exist_ok=True)

    # Lookup --------------------------------------------------------------------------

    def get(self, policy_id: str, version: int) -> VersionEntry | None:
        return self.entries.get((policy_id, version))

    def current_version(self, policy_id: str) -> int:
        """Newest complete version of `policy_id`, -1 if none."""
        done = [v for (p, v), e in self.entries.items() if p == policy_id and e.complete]
        return max(done, default=-1)

    def _version_dir(self, policy_id: str, version: int) -> Path:
        if not POLICY_DIR.match(policy_id):
            raise StoreError(f"policy id {policy_id[:64]!r} is not a valid directory name")
        return self.root / policy_id / f"{version:012d}"

    # Opening and resuming ------------------------------------------------------------

    def load(self, check=None) -> list[VersionEntry]:
        """Rediscover versions on disk after a restart (re-verifying every shard found).

        `check(manifest)` returns (reason, detail) for a manifest this node must not act on
        (unsafe file names, over the limits). Such a version, and one whose directory
        cannot be opened, is moved to `<root>/.quarantine/` with one log line: a bad stored
        manifest never stops the node from starting."""
        found = []
        for mf in sorted(self.root.glob(f"*/*/{MANIFEST_FILE}")):
            if not POLICY_DIR.match(mf.parent.parent.name):
                continue  # .quarantine and anything else that is not ours
            try:
                data = mf.read_bytes()
                env = open_envelope(data, expected_type=CheckpointManifest.TYPE,
                                    max_skew_s=None)
                m = env.message
                problem = check(m) if check is not None else None
                if problem:
                    raise StoreError(f"{problem[0]}: {problem[1]}", reason=problem[0])
                if mf.parent != self._version_dir(m.policy_id, m.version):
                    raise StoreError("directory does not match its manifest")
                found.append(self._open(AcceptedManifest(m, data, env.sender)))
            except (OSError, ProtocolError, StoreError, ValueError) as e:
                self.quarantine(mf.parent, e)
        return found

    def quarantine(self, path: Path, why: BaseException) -> None:
        """Move a version directory out of the way (kept for inspection, never loaded)."""
        dest = self.root / QUARANTINE_DIR / f"{path.parent.name[-16:]}-{path.name}-{os.getpid()}"
        try:
            dest.parent.mkdir(exist_ok=True)
            shutil.rmtree(dest, ignore_errors=True)
            os.replace(path, dest)
            log.warning("stored manifest %s quarantined to %s: %s", path, dest, why)
        except OSError as e:
            shutil.rmtree(path, ignore_errors=True)
            log.warning("stored manifest %s deleted (%s; quarantine failed: %s)", path, why, e)
        for key in [k for k, e in self.entries.items() if e.path == path]:
            self._forget(key)

    def open_version(self, accepted: AcceptedManifest) -> VersionEntry:
        """The entry for an accepted manifest, created or resumed from disk."""
        entry = self.entries.get((accepted.manifest.policy_id, accepted.manifest.version))
        return entry if entry is not None else self._open(accepted)

    def _open(self, accepted: AcceptedManifest) -> VersionEntry:
        m = accepted.manifest
        path = self._version_dir(m.policy_id, m.version)
        path.mkdir(parents=True, exist_ok=True)
        mf = path / MANIFEST_FILE
        if not mf.exists() or mf.read_bytes() != accepted.envelope:
            tmp = path / (MANIFEST_FILE + ".tmp")
            tmp.write_bytes(accepted.envelope)
            os.replace(tmp, mf)
        entry = VersionEntry(m, accepted.envelope, path)
        if (path / COMPLETE_FILE).exists() and entry.checkpoint_dir.is_dir():
            entry.complete = True
        else:
            shutil.rmtree(entry.checkpoint_dir, ignore_errors=True)
            self._prepare_partial(entry)
            self._rescan(entry)
        self.entries[entry.key] = entry
        return entry

    def _prepare_partial(self, entry: VersionEntry) -> None:
        """Create the checkpoint files at their final sizes (sparse) if not all there."""
        d = entry.partial_dir
        ok = d.is_dir() and all((d / f.name).is_file() and (d / f.name).stat().st_size == f.size
                                for f in entry.manifest.files)
        if ok:
            return
        shutil.rmtree(d, ignore_errors=True)
        entry.bitmap_path.unlink(missing_ok=True)
        d.mkdir(parents=True)
        for f in entry.manifest.files:
            with open(d / f.name, "wb") as out:
                out.truncate(f.size)

    def _rescan(self, entry: VersionEntry) -> None:
        """Resume: keep only the shards the bitmap claims that still hash correctly."""
        try:
            bits = entry.bitmap_path.read_bytes()
        except OSError:
            return
        m = entry.manifest
        for i in range(min(m.num_shards, len(bits) * 8)):
            if not bits[i // 8] >> (i % 8) & 1:
                continue
            start, end = m.shard_range(i)
            h = blake3.blake3()
            for data in iter_range(entry.partial_dir, m.files, start, end):
                h.update(data)
            if h.digest() == m.shard_hashes[i]:
                entry.mark(i)
            else:
                log.warning("shard %d of %s v%d no longer verifies: re-fetching it", i,
                            m.policy_id, m.version)
        entry.save_bitmap()

    def add_checkpoint(self, accepted: AcceptedManifest, ckpt_dir: Path) -> VersionEntry:
        """The origin's own checkpoint: linked (or copied) into the store, complete."""
        entry = self.open_version(accepted)
        if entry.complete:
            return entry
        tmp = entry.path / "checkpoint.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        for f in entry.manifest.files:
            src, dst = Path(ckpt_dir) / f.name, tmp / f.name
            try:
                os.link(src, dst)
            except OSError:
                shutil.copyfile(src, dst)
            if dst.stat().st_size != f.size:
                raise StoreError(f"{src}: size changed since the manifest was built")
        os.replace(tmp, entry.checkpoint_dir)
        (entry.path / COMPLETE_FILE).touch()
        entry.complete = True
        shutil.rmtree(entry.partial_dir, ignore_errors=True)
        entry.bitmap_path.unlink(missing_ok=True)
        entry.clear_shards()
        return entry

    # Writing, reading, assembling ----------------------------------------------------

    def begin_shard(self, entry: VersionEntry, index: int,
                    whole: InOrderHash | None = None) -> ShardWriter:
        return ShardWriter(entry, index, whole)

    def read_shard(self, entry: VersionEntry, index: int, offset: int = 0,
                   length: int = 0, chunk: int = READ_CHUNK) -> Iterator[bytes]:
        """Verified bytes of shard `index` from `offset` (length 0: to the shard's end)."""
        size = entry.shard_len(index)
        end = size if length == 0 else offset + length
        start, _ = entry.manifest.shard_range(index)
        where = entry.checkpoint_dir if entry.complete else entry.partial_dir
        return iter_range(where, entry.manifest.files, start + offset, start + end, chunk)

    def shard_files(self, entry: VersionEntry, index: int, offset: int,
                    length: int) -> list[tuple[Path, int, int]]:
        """(file path, offset in file, length) pieces of shard `index` bytes [offset,
        offset+length), for zero-copy sending."""
        start, _ = entry.manifest.shard_range(index)
        where = entry.checkpoint_dir if entry.complete else entry.partial_dir
        return [(where / name, off, n) for name, off, n in
                entry.file_spans(start + offset, start + offset + length)]

    def assemble(self, entry: VersionEntry, whole: InOrderHash | None = None) -> Path:
        """Check the checkpoint hash over the verified shards and move the files into
        `checkpoint/` (a rename, no copy). A "blake3-shard-list" hash is the hash of the
        verified shards' hashes: no pass over the bytes.

        Raises StoreError(reason="checkpoint_hash_mismatch") and deletes the version if the
        shards verify but the whole does not (an inconsistent manifest).
        """
        if entry.complete:
            return entry.checkpoint_dir
        if entry.missing_count():
            raise StoreError(f"{entry.missing_count()} shards missing", reason="incomplete")
        m = entry.manifest
        if m.hash_algo == SHARD_LIST:  # checked against the shard hashes at the gate
            digest = m.shard_list_hash()
        else:
            digest = whole.finish() if whole is not None else None
        if digest is None:
            # one thread: BLAKE3's own threads cost more CPU than they save on a busy box
            # (256 MiB from the page cache: 0.10-0.18 CPU-s with AUTO, 0.085 with one)
            h = blake3.blake3()
            _hash_into(h, [entry.partial_dir / f.name for f in m.files])
            digest = h.digest()
        if digest != m.checkpoint_hash:
            self.remove(entry)
            raise StoreError(f"{m.policy_id} v{m.version}: whole-checkpoint hash mismatch",
                             reason="checkpoint_hash_mismatch")
        os.replace(entry.partial_dir, entry.checkpoint_dir)
        (entry.path / COMPLETE_FILE).touch()
        entry.complete = True
        entry.bitmap_path.unlink(missing_ok=True)
        entry.clear_shards()
        return entry.checkpoint_dir

    # Retention -----------------------------------------------------------------------

    def remove(self, entry: VersionEntry) -> None:
        if entry.key in self.entries:
            self._forget(entry.key)
        entry.complete = False
        entry.clear_shards()
        shutil.rmtree(entry.path, ignore_errors=True)

    def _forget(self, key: tuple[str, int]) -> None:
        del self.entries[key]
        for removed in self.on_removed:
            removed(key)

    def prune(self, policy_id: str, keep: int | None = None) -> list[int]:
        """Keep the newest `keep` complete versions of a policy (and any incomplete version
        newer than the newest complete one); delete the rest. Returns deleted versions."""
        keep = self.keep_versions if keep is None else keep
        mine = sorted((e for (p, _), e in self.entries.items() if p == policy_id),
                      key=lambda e: e.manifest.version, reverse=True)
        complete = [e for e in mine if e.complete]
        newest = complete[0].manifest.version if complete else -1
        kept = {id(e) for e in complete[:keep]}
        dropped = []
        for e in mine:
            if id(e) in kept or (not e.complete and e.manifest.version > newest):
                continue
            self.remove(e)
            dropped.append(e.manifest.version)
        return dropped
