"""Checkpoint manifests: build one from a checkpoint directory, and decide whether to accept
one that arrived from a peer.

The checkpoint is the concatenation of its files in manifest order; shard i covers bytes
[i*shard_size, min((i+1)*shard_size, total_size)). Every shard is hashed with BLAKE3; the
checkpoint hash is BLAKE3 of the shard hashes (hash_algo "blake3-shard-list"), or of the
whole concatenation in manifests of older nodes ("blake3"). A manifest travels inside the
trainer's signed envelope; the same envelope bytes are kept on disk and re-served, so a
manifest fetched from a relay still carries the trainer's signature.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import blake3

from ...protocol.codec import pack, unpack
from ...protocol.envelope import Envelope, open_envelope
from ...protocol.errors import ProtocolError, SchemaViolation
from ...protocol.limits import Limits
from ...protocol.messages import CheckpointManifest, FileEntry, shard_list_hash
from ..diskspace import DiskFull
from .errors import BroadcastError, ManifestRejected

READ_CHUNK = 1 << 20
WHOLE, SHARD_LIST = "blake3", "blake3-shard-list"  # CheckpointManifest.hash_algo
FILE_NAME = re.compile(r"^[A-Za-z0-9._-]+$")


def checkpoint_files(ckpt_dir: Path) -> list[FileEntry]:
    """The files of a checkpoint directory in manifest order (sorted by name).

    Only regular top-level files; hidden files are skipped; a subdirectory is an error
    (the manifest layout is flat).
    """
    ckpt_dir = Path(ckpt_dir)
    entries = []
    for path in sorted(ckpt_dir.iterdir(), key=lambda p: p.name):
        if path.name.startswith("."):
            continue
        if not path.is_file() or path.is_symlink():
            raise BroadcastError(f"{path}: checkpoint directories must hold only regular files")
        if not FILE_NAME.match(path.name) or len(path.name) > 255:
            raise BroadcastError(f"{path.name!r}: file name not allowed in a manifest")
        entries.append(FileEntry(name=path.name, size=path.stat().st_size))
    if not entries:
        raise BroadcastError(f"{ckpt_dir}: no files to publish")
    return entries


def iter_range(ckpt_dir: Path, files: list[FileEntry], start: int, end: int,
               chunk: int = READ_CHUNK) -> Iterator[bytes]:
    """Bytes [start, end) of the concatenation of `files` under `ckpt_dir`, in chunks."""
    pos = 0
    for entry in files:
        f_start, f_end = pos, pos + entry.size
        pos = f_end
        if f_end <= start or entry.size == 0:
            continue
        if f_start >= end:
            break
        lo, hi = max(start, f_start) - f_start, min(end, f_end) - f_start
        with open(Path(ckpt_dir) / entry.name, "rb") as f:
            f.seek(lo)
            left = hi - lo
            while left > 0:
                data = f.read(min(chunk, left))
                if not data:
                    raise BroadcastError(f"{entry.name}: shorter than its manifest size")
                left -= len(data)
                yield data


def _whole_hash(ckpt_dir: Path, files: list[FileEntry], total: int) -> bytes:
    h = blake3.blake3()
    for data in iter_range(ckpt_dir, files, 0, total):
        h.update(data)
    return h.digest()


def _shard_hashes(ckpt_dir: Path, files: list[FileEntry], total: int,
                  shard_size: int) -> list[bytes]:
    hashes = []
    for start in range(0, total, shard_size):
        h = blake3.blake3()
        n = 0
        for data in iter_range(ckpt_dir, files, start, min(start + shard_size, total)):
            h.update(data)
            n += len(data)
        if n != min(shard_size, total - start):
            raise BroadcastError(f"{ckpt_dir}: files changed while hashing")
        hashes.append(h.digest())
    return hashes


def build_manifest(ckpt_dir: Path, *, policy_id: str, version: int, shard_size: int,
                   parent_version: int = -1, settings=None,
                   hash_algo: str = SHARD_LIST) -> CheckpointManifest:
    """Hash `ckpt_dir` shard by shard (bounded memory; CPU-bound: call it in a thread).

    `hash_algo` "blake3-shard-list" (the default): one pass over the bytes, checkpoint_hash
    from the shard hashes. "blake3" (older nodes' manifests): the whole-checkpoint hash runs
    in a second thread beside the shard hashes (BLAKE3 releases the GIL)."""
    files = checkpoint_files(ckpt_dir)
    total = sum(f.size for f in files)
    if total == 0:
        raise BroadcastError(f"{ckpt_dir}: checkpoint is empty")
    if hash_algo == WHOLE:
        with ThreadPoolExecutor(1, thread_name_prefix="manifest-hash") as pool:
            whole = pool.submit(_whole_hash, ckpt_dir, files, total)
            shard_hashes = _shard_hashes(ckpt_dir, files, total, shard_size)
            checkpoint_hash = whole.result()
    else:
        shard_hashes = _shard_hashes(ckpt_dir, files, total, shard_size)
        checkpoint_hash = shard_list_hash(total, shard_size, shard_hashes)
    return CheckpointManifest(
        policy_id=policy_id, version=version, parent_version=parent_version,
        created_ms=int(time.time() * 1000), hash_algo=hash_algo, files=files,
        total_size=total, shard_size=shard_size, shard_hashes=shard_hashes,
        checkpoint_hash=checkpoint_hash, settings=settings)


def envelope_bytes(env: Envelope) -> bytes:
    """The wire form of an opened envelope (re-served as is; the signature still holds)."""
    return pack([env.version, env.type, env.sender, env.ts_ms, env.nonce, env.payload,
                 env.signature])


def _layout_problem(payload: bytes) -> str | None:
    """Why a manifest payload that failed schema validation has an inconsistent layout."""
    try:
        raw = unpack(payload, max_size=Limits().max_for(CheckpointManifest.TYPE))
        sizes = [f["size"] for f in raw["files"]]
        total, shard, hashes = raw["total_size"], raw["shard_size"], raw["shard_hashes"]
        if sum(sizes) != total:
            return f"file sizes add up to {sum(sizes)}, total_size is {total}"
        if isinstance(shard, int) and shard > 0 and len(hashes) != -(-total // shard):
            return f"{len(hashes)} shard hashes, layout needs {-(-total // shard)}"
    except (ProtocolError, KeyError, TypeError, ValueError):
        return None
    return None


@dataclass(frozen=True)
class AcceptedManifest:
    manifest: CheckpointManifest
    envelope: bytes  # the trainer's signed envelope, kept and re-served as is
    sender: str


def file_name_problem(name: str) -> str | None:
    """Why `name` may not be a file of a stored checkpoint (None: it is safe).

    Only plain names inside one directory: no separators, not `.`/`..`, no hidden files
    (they could shadow our own bookkeeping files), printable ASCII of `[A-Za-z0-9._-]`."""
    if not name:
        return "empty file name"
    if len(name) > 255 or not FILE_NAME.match(name):
        return f"file name {name[:64]!r} has characters outside [A-Za-z0-9._-]"
    if name.startswith("."):
        return f"file name {name[:64]!r} is hidden or a relative path"
    return None


def layout_problem(m: CheckpointManifest, *, min_shard_size: int, max_shard_size: int,
                   max_checkpoint_bytes: int, max_shards: int) -> tuple[str, str] | None:
    """(reason, detail) if a manifest's layout is outside this node's limits or unsafe to
    write; None if it may be stored. Checked before any byte is written, and again for
    each stored manifest on start. The shard count first: it bounds the work of the rest
    (and of a download)."""
    if m.num_shards > max_shards:
        return "too_many_shards", (f"{m.num_shards} shards > broadcast.max_shards "
                                   f"{max_shards}")
    for f in m.files:
        problem = file_name_problem(f.name)
        if problem:
            return "bad_file_name", problem
    if not min_shard_size <= m.shard_size <= max_shard_size:
        return "bad_layout", (f"shard size {m.shard_size} outside "
                              f"[{min_shard_size}, {max_shard_size}]")
    if m.total_size > max_checkpoint_bytes:
        return "too_large", f"{m.total_size} bytes > {max_checkpoint_bytes}"
    if m.parent_version >= m.version:
        return "bad_layout", "parent_version is not older than version"
    if m.hash_algo == SHARD_LIST and m.checkpoint_hash != m.shard_list_hash():
        return "checkpoint_hash_mismatch", "checkpoint_hash is not the hash of the shard hashes"
    return None


class ManifestGate:
    """Decides which manifests a node acts on.

    Accepted only if: the envelope's signature verifies; its sender is a followed trainer
    (`follow`; empty: nobody, until `follow_policy` adds one); `policy_id` equals the
    sender; the version is newer than `current_version(policy_id)`; the layout is
    consistent, its file names safe and its size within this node's limits and within the
    free disk space (`space_check(total_size)` raises DiskFull otherwise). Each rejection
    is a `ManifestRejected` with a reason code and is counted in `rejected`.
    """

    def __init__(self, follow: list[str], *, min_shard_size: int, max_shard_size: int,
                 max_checkpoint_bytes: int, current_version: Callable[[str], int],
                 max_shards: int = 1 << 14,
                 space_check: Callable[[CheckpointManifest], None] | None = None,
                 settings_check: Callable[..., str | None] | None = None):
        self.follow = set(follow)
        self.limits = {"min_shard_size": min_shard_size, "max_shard_size": max_shard_size,
                       "max_checkpoint_bytes": max_checkpoint_bytes, "max_shards": max_shards}
        self.current_version = current_version
        self.space_check = space_check
        self.settings_check = settings_check  # (settings, trainer, version) -> refusal or None
        self.rejected: dict[str, int] = {}

    @classmethod
    def from_config(cls, follow: list[str], cfg, current_version: Callable[[str], int],
                    space_check: Callable[[CheckpointManifest], None] | None = None,
                    settings_check: Callable[..., str | None] | None = None):
        return cls(follow, min_shard_size=cfg.min_shard_size, max_shard_size=cfg.max_shard_size,
                   max_checkpoint_bytes=cfg.max_checkpoint_bytes, max_shards=cfg.max_shards,
                   current_version=current_version, space_check=space_check,
                   settings_check=settings_check)

    def _reject(self, reason: str, detail: str) -> ManifestRejected:
        self.rejected[reason] = self.rejected.get(reason, 0) + 1
        return ManifestRejected(f"manifest rejected ({reason}): {detail}", reason=reason)

    def follows(self, sender) -> bool:
        return sender in self.follow

    def follow_policy(self, policy_id: str) -> None:
        """Start following `policy_id` (an explicit choice: see follow.py)."""
        self.follow.add(policy_id)

    def problem(self, m: CheckpointManifest) -> tuple[str, str] | None:
        return layout_problem(m, **self.limits)

    def check_bytes(self, data: bytes) -> AcceptedManifest:
        """Open and check a sealed manifest envelope (signature checked here)."""
        try:
            env = open_envelope(data, expected_type=CheckpointManifest.TYPE, max_skew_s=None)
        except SchemaViolation as e:
            sender, payload = _sender_payload_of(data)
            if not self.follows(sender):
                raise self._reject("not_followed", f"{sender} is not a followed trainer") from None
            problem = _layout_problem(payload) if payload is not None else None
            if problem:
                raise self._reject("bad_layout", problem) from None
            raise self._reject(e.reason, str(e)) from None
        except ProtocolError as e:
            raise self._reject(e.reason, str(e)) from None
        return self.check_envelope(env, data)

    def check_envelope(self, env: Envelope, data: bytes | None = None) -> AcceptedManifest:
        """Check an envelope whose signature the transport already verified."""
        if env.type != CheckpointManifest.TYPE or not isinstance(env.message, CheckpointManifest):
            raise self._reject("unknown_type", f"expected a manifest, got {env.type}")
        m: CheckpointManifest = env.message
        if not self.follows(env.sender):
            raise self._reject("not_followed", f"{env.sender} is not a followed trainer")
        if m.policy_id != env.sender:
            raise self._reject("policy_mismatch",
                               f"policy {m.policy_id} announced by {env.sender}")
        current = self.current_version(m.policy_id)
        if m.version <= current:
            raise self._reject("not_newer", f"version {m.version}, have {current}")
        problem = self.problem(m)
        if problem:
            raise self._reject(*problem)
        if self.settings_check is not None:
            refusal = self.settings_check(m.settings, env.sender, m.version)
            if refusal:
                raise self._reject("settings_mismatch", refusal)
        if self.space_check is not None:
            try:
                self.space_check(m)
            except DiskFull as e:
                raise self._reject("no_space", str(e)) from None
        return AcceptedManifest(m, data if data is not None else envelope_bytes(env), env.sender)


def _sender_payload_of(data: bytes) -> tuple[str | None, bytes | None]:
    try:
        raw = unpack(data, max_size=Limits().max_envelope())
    except ProtocolError:
        return None, None
    if not isinstance(raw, list) or len(raw) != 7 or not isinstance(raw[5], bytes):
        return None, None
    return raw[2], raw[5]
