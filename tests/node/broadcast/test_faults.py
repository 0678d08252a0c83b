"""Fault tests with real processes on loopback (libp2p hosts, gossip, shard streams)."""

from __future__ import annotations

from pathlib import Path

import pytest
from swarm_node.node.broadcast.manifest import build_manifest
from swarm_node.node.config import BroadcastSection
from swarm_node.node.identity import Identity
from swarm_node.protocol.codec import pack, unpack
from swarm_node.protocol.messages import CheckpointManifest

from .conftest import SHARD, make_checkpoint, read_dir

pytestmark = pytest.mark.slow


def manifest_file(data_dir: Path, policy: str, version: int) -> Path:
    return data_dir / "broadcast" / policy / f"{version:012d}" / "manifest.env"


async def seeded_swarm(tmp_path, procs, ckpt, relays: dict[str, list[str]]):
    """A trainer that published v1 and relays that hold all of it."""
    key = tmp_path / "trainer.pem"
    Identity.generate().save(key)
    trainer = procs("trainer", "trainer", tmp_path / "trainer", key=key)
    await trainer.ready()
    started = {}
    for name, extra in relays.items():
        r = procs(name, "relay", tmp_path / name, "--follow", trainer.peer_id,
                  *boot_args(trainer.addrs), *extra)
        started[name] = r
    for r in started.values():
        await r.ready()
    trainer.send(f"publish {ckpt} 1")
    await trainer.event("published")
    for r in started.values():
        done = await r.event("complete", timeout=90)
        assert read_dir(Path(done["path"])) == read_dir(ckpt)
    return key, trainer, started


def boot_args(addrs: list[str]) -> list[str]:
    return [arg for a in addrs for arg in ("--bootstrap", a)]


def client(procs, tmp_path, name, trainer, bootstrap, *extra, **kw):
    return procs(name, "inference", tmp_path / name, "--follow", trainer.peer_id,
                 *boot_args(bootstrap), *extra, **kw)


async def test_relay_killed_mid_transfer(tmp_path, procs):
    ckpt = make_checkpoint(tmp_path / "ckpt", {"model.safetensors": 6 * 2**20, "config.json": 999})
    _key, trainer, relays = await seeded_swarm(tmp_path, procs, ckpt, {"r1": [], "r2": []})
    for p in (trainer, *relays.values()):
        p.send("rate 1.5")  # slow sources, so that a kill lands mid-transfer
        await p.event("rate")
    c = client(procs, tmp_path, "c1", trainer, relays["r1"].addrs + relays["r2"].addrs,
               "--shard-events")
    await c.ready()
    c.send(f"offer {manifest_file(tmp_path / 'trainer', trainer.peer_id, 1)}")
    await c.event("accepted")
    await c.event("shard", timeout=90, source=relays["r1"].peer_id)  # r1 is one source
    relays["r1"].kill()
    done = await c.event("complete", timeout=90)
    assert read_dir(Path(done["path"])) == read_dir(ckpt)
    r1 = done["sources"].get(relays["r1"].peer_id)
    assert r1 is not None and (r1["shards_ok"] > 0 or r1["failures"] > 0), done["sources"]
    # shards the dead relay did not finish were fetched from the others
    assert done["metrics"]["shards_ok"] == -(-(6 * 2**20 + 999) // SHARD)


async def test_corrupt_relay_is_penalised_and_costs_only_bad_shards(tmp_path, procs):
    size = 4 * 2**20 + 12345
    ckpt = make_checkpoint(tmp_path / "ckpt", {"model.safetensors": size})
    _key, trainer, relays = await seeded_swarm(
        tmp_path, procs, ckpt, {"good": [], "evil": ["--corrupt-shards", ",".join(
            str(i) for i in range(64))]})
    trainer.send("rate 2")
    await trainer.event("rate")
    c = client(procs, tmp_path, "c1", trainer, relays["good"].addrs + relays["evil"].addrs)
    await c.ready()
    c.send(f"offer {manifest_file(tmp_path / 'trainer', trainer.peer_id, 1)}")
    await c.event("accepted")
    done = await c.event("complete", timeout=90)
    assert read_dir(Path(done["path"])) == read_dir(ckpt)
    evil = done["sources"][relays["evil"].peer_id]
    m = done["metrics"]
    assert evil["corrupt"] >= 1 and evil["dropped"] and evil["shards_ok"] == 0
    in_flight = BroadcastSection().per_source_downloads  # bad shards caught before the drop
    assert m["shards_corrupt"] == evil["corrupt"] <= in_flight
    # only the bad shards were fetched twice
    assert m["bytes_fetched"] - size == m["bytes_corrupt"] + m.get("bytes_wasted", 0)
    assert m["bytes_corrupt"] <= in_flight * SHARD


async def test_client_killed_and_restarted_resumes(tmp_path, procs):
    size = 6 * 2**20
    ckpt = make_checkpoint(tmp_path / "ckpt", {"model.safetensors": size})
    _key, trainer, _ = await seeded_swarm(tmp_path, procs, ckpt, {})
    trainer.send("rate 1.5")
    await trainer.event("rate")
    ckey = tmp_path / "c1.pem"
    Identity.generate().save(ckey)
    c = client(procs, tmp_path, "c1", trainer, trainer.addrs, "--shard-events", key=ckey)
    await c.ready()
    c.send(f"offer {manifest_file(tmp_path / 'trainer', trainer.peer_id, 1)}")
    await c.event("accepted")
    for _ in range(8):  # each in the bitmap on disk when it is said
        await c.event("shard", timeout=90)
    c.kill()
    bitmap = tmp_path / "c1" / "broadcast" / trainer.peer_id / f"{1:012d}" / "verified.bin"
    kept = sum(b.bit_count() for b in bitmap.read_bytes())
    assert 0 < kept < -(-size // SHARD)
    # the same key and data directory as the killed client
    again = procs("c1-restarted", "inference", tmp_path / "c1", "--follow", trainer.peer_id,
                  *boot_args(trainer.addrs), key=ckey)
    await again.ready()
    done = await again.event("complete", timeout=90)
    assert read_dir(Path(done["path"])) == read_dir(ckpt)
    m = done["metrics"]
    assert m["shards_resumed"] == kept
    assert m["bytes_fetched"] == size - kept * SHARD


async def test_forged_manifests_are_rejected_with_reasons(tmp_path, procs):
    ckpt = make_checkpoint(tmp_path / "ckpt", {"model.safetensors": 300_000})
    key, trainer, _ = await seeded_swarm(tmp_path, procs, ckpt, {})
    ident = Identity.load(key)
    c = client(procs, tmp_path, "c1", trainer, trainer.addrs)
    await c.ready()
    real = manifest_file(tmp_path / "trainer", trainer.peer_id, 1)
    c.send(f"offer {real}")
    await c.event("accepted")
    await c.event("complete", timeout=60)

    def write(name, data: bytes) -> Path:
        path = tmp_path / name
        path.write_bytes(data)
        return path

    good = build_manifest(ckpt, policy_id=trainer.peer_id, version=2, shard_size=SHARD)
    env = unpack(ident.seal(good), max_size=1 << 24)
    env[6] = bytes([env[6][0] ^ 1]) + env[6][1:]
    other = Identity.generate()
    fields = {**good.model_dump(), "files": good.files}
    cases = {
        "bad_signature": write("badsig", pack(env)),
        "not_followed": write("unknown", other.seal(build_manifest(
            ckpt, policy_id=other.peer_id, version=2, shard_size=SHARD))),
        "not_newer": write("older", ident.seal(build_manifest(
            ckpt, policy_id=trainer.peer_id, version=1, shard_size=SHARD))),
        "bad_layout": write("count", ident.seal(CheckpointManifest.model_construct(
            **{**fields, "shard_hashes": good.shard_hashes[:-1]}))),
    }
    cases_size = write("size", ident.seal(CheckpointManifest.model_construct(
        **{**fields, "total_size": good.total_size + SHARD})))
    for reason, path in [*cases.items(), ("bad_layout", cases_size)]:
        c.send(f"offer {path}")
        ev = await c.event("rejected")
        assert ev["reason"] == reason, ev
