"""Fixtures for broadcast tests: real checkpoint files, real keys, real signed manifests,
and real broadcast peers in subprocesses (`procs`)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from swarm_node.node.broadcast.manifest import SHARD_LIST, AcceptedManifest, build_manifest
from swarm_node.node.config import BroadcastSection, Config, load_config
from swarm_node.node.identity import Identity

from tests.waiting import async_wait_until

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


def huge_manifest(policy_id: str, n: int = 120_000, size: int = 64 * 1024):
    """A valid shard-list manifest of `n` shards of `size` bytes (random hashes): what the
    4 MiB manifest limit lets through, for the shard-count limit's tests."""
    import os

    from swarm_node.protocol.messages import CheckpointManifest, FileEntry, shard_list_hash

    hashes = [os.urandom(32) for _ in range(n)]
    return CheckpointManifest(policy_id=policy_id, version=1, hash_algo="blake3-shard-list",
                              files=[FileEntry(name="model.safetensors", size=n * size)],
                              total_size=n * size, shard_size=size, shard_hashes=hashes,
                              checkpoint_hash=shard_list_hash(n * size, size, hashes))


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
        p = BroadcastProc(name, role, data_dir, *COMMON, *args, fork=True, **kw)
        started.append(p)
        return p

    yield start
    for p in started:
        p.stop()


def boot(*peers: BroadcastProc) -> list[str]:
    """--bootstrap arguments for every listen address of `peers`."""
    return [arg for p in peers for a in p.addrs for arg in ("--bootstrap", a)]


class Completions:
    """What a broadcaster handed over (its `on_complete`), to wait on in tests."""

    def __init__(self):
        self.got: dict[tuple[str, int], object] = {}
        self._changed = asyncio.Event()

    def __call__(self, done) -> None:
        self.got[(done.manifest.policy_id, done.manifest.version)] = done
        self._changed.set()

    async def wait(self, policy_id: str, version: int, timeout: float = 60):
        async with asyncio.timeout(timeout):
            while (policy_id, version) not in self.got:
                self._changed.clear()
                await self._changed.wait()
        return self.got[(policy_id, version)]


async def until(pred, timeout: float = 30, what: str = "condition"):
    """`pred()`'s value once true (tests/waiting.py: for state nothing signals)."""
    return await async_wait_until(pred, timeout, what)


async def wait_mesh(node, kind: str, n: int, timeout: float = 30) -> None:
    """Until `node` sees `n` peers subscribed to gossip topic `kind`."""
    await until(lambda: len(node.gossip.topic_peers(kind)) >= n, timeout, f"{n} peers on {kind}")


def node_config(**overrides) -> Config:
    """A test node's config; `overrides` with `__` for the dot (`bulk__listen="off"`)."""
    return load_config(None, {
        "node.listen": ["/ip4/127.0.0.1/tcp/0"], "p2p.discovery_interval_s": 0.5,
        "p2p.bootstrap_timeout_s": 30, "p2p.dial_timeout_s": 3, "p2p.mesh_wait_s": 3,
        "broadcast.shard_size": 64 * 1024, "broadcast.min_shard_size": 4096,
        "broadcast.chunk_size": 32 * 1024, "broadcast.advert_interval_s": 0.1,
        "broadcast.readvertise_s": 0.5,
        **{k.replace("__", "."): v for k, v in overrides.items()}})


def behind_nat(node) -> None:
    """Pin `node`'s own reachability verdict to `unreachable`, as a node behind NAT without
    a relay slot finds it (on 127.0.0.1 every peer could dial it back): its later dial-back
    results are ignored. Everything else about the node is real."""
    node.reach.set_dialback(False, [], "test: behind NAT")
    node.reach.set_dialback = lambda *a, **kw: None


@pytest.fixture
async def swarm(tmp_path):
    """`await swarm(name, role, follow=(), bootstrap=(), ...)`: a real libp2p host on
    127.0.0.1 and a Broadcaster over it (`bc.done`: its Completions); all closed after.
    `natted=True`: the node's own reachability verdict says behind NAT (`behind_nat`)."""
    from swarm_node.node.broadcast.service import Broadcaster
    from swarm_node.node.p2p import P2PNode

    made = []

    async def make(name, role, follow=(), bootstrap=(), identity=None, bulk=False,
                   libp2p_only=False, cfg=None, natted=False, **kw):
        cfg = cfg or node_config()
        if bulk:
            cfg = cfg.with_overrides({"bulk.listen": "127.0.0.1:0"})
        if libp2p_only:
            cfg = cfg.with_overrides({"bulk.listen": "off"})
        node = P2PNode(identity or Identity.generate(), cfg)
        if natted:
            behind_nat(node)
        await node.start(bootstrap=list(bootstrap))
        done = Completions()
        bc = Broadcaster(node, cfg.broadcast, tmp_path / name, follow=list(follow), role=role,
                         interactive=False, on_complete=done, **kw)
        bc.done = done
        await bc.start()
        made.append((node, bc))
        return node, bc

    yield make
    for node, bc in reversed(made):
        await bc.close()
        await node.close()
