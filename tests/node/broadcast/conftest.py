"""Fixtures for broadcast tests: real checkpoint files, real keys, real signed manifests,
and real broadcast peers in subprocesses (`procs`)."""

from __future__ import annotations

from pathlib import Path

import pytest
from swarm_node.node.broadcast.manifest import SHARD_LIST, AcceptedManifest, build_manifest
from swarm_node.node.config import BroadcastSection
from swarm_node.node.identity import Identity

from .procs import BroadcastProc

SHARD = 128 * 1024  # shard size of the subprocess peers (`procs`)
COMMON = ["--shard-size", str(SHARD), "--readvertise", "0.5", "--chunk-timeout", "3"]


def make_checkpoint(path: Path, sizes: dict[str, int], seed: int = 0) -> Path:
    """A checkpoint directory with files of pseudo-random bytes."""
    import random

    rng = random.Random(seed)
    path.mkdir(parents=True, exist_ok=True)
    for name, size in sizes.items():
        (path / name).write_bytes(rng.randbytes(size))
    return path


def publish(identity: Identity, ckpt: Path, version: int, shard_size: int,
            hash_algo: str = SHARD_LIST) -> AcceptedManifest:
    m = build_manifest(ckpt, policy_id=identity.peer_id, version=version, shard_size=shard_size,
                       hash_algo=hash_algo)
    return AcceptedManifest(m, identity.seal(m), identity.peer_id)


def read_dir(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(Path(path).iterdir())}


@pytest.fixture
def trainer() -> Identity:
    return Identity.generate()


@pytest.fixture
def ckpt(tmp_path) -> Path:
    # 3 files, 300 KiB + odd sizes: shards straddle file boundaries
    return make_checkpoint(tmp_path / "ckpt", {"config.json": 1234,
                                               "model.safetensors": 300 * 1024 + 17,
                                               "tokenizer.json": 40_000})


@pytest.fixture
def cfg() -> BroadcastSection:
    return BroadcastSection(shard_size=64 * 1024, min_shard_size=4096, chunk_size=16 * 1024,
                            request_timeout_s=2.0, chunk_timeout_s=2.0, stall_timeout_s=10.0,
                            parallel_downloads=4)


@pytest.fixture
def procs():
    """`procs(name, role, data_dir, *args, key=None)` starts a broadcast peer subprocess
    (SHARD-sized shards, fast re-adverts); every one started is stopped after the test."""
    started: list[BroadcastProc] = []

    def start(name, role, data_dir, *args, **kw):
        p = BroadcastProc(name, role, data_dir, *COMMON, *args, **kw)
        started.append(p)
        return p

    yield start
    for p in started:
        p.stop()


def boot(*peers: BroadcastProc) -> list[str]:
    """--bootstrap arguments for every listen address of `peers`."""
    return [arg for p in peers for a in p.addrs for arg in ("--bootstrap", a)]
