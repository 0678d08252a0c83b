"""Issue 17 findings 3, 4, 6 and 9 against real processes, real hosts and real filesystems:
who may publish a policy, unsafe stored manifests, advert poisoning, a disk that fills."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
from pathlib import Path

import pytest
from swarm_node.node.broadcast.follow import FOLLOW_FILE
from swarm_node.node.broadcast.manifest import build_manifest
from swarm_node.node.broadcast.store import QUARANTINE_DIR, ShardStore
from swarm_node.node.config import BroadcastSection, load_config
from swarm_node.node.identity import Identity
from swarm_node.protocol.messages import CheckpointManifest, FileEntry, ShardAdvert

from tests.launch import start_demo_node
from tests.waiting import async_wait_until

from .conftest import SHARD, boot, huge_manifest, make_checkpoint, read_dir
from .procs import BroadcastProc


def manifest_file(data_dir: Path, policy: str, version: int) -> Path:
    return data_dir / "broadcast" / policy / f"{version:012d}" / "manifest.env"


async def stats(p: BroadcastProc) -> dict:
    p.send("stats")
    return await p.event("stats")


async def wait_for(pred, timeout: float = 60, what: str = "condition"):
    """The value of `await pred()` once true: a peer process's stats, asked over its pipe
    (tests/waiting.py)."""
    return await async_wait_until(pred, timeout, what, interval=0.2)


# 17.4: unsafe names in a stored manifest ------------------------------------------------


def store_dotdot_manifest(root: Path, trainer: Identity, ckpt: Path) -> Path:
    """What a node before this fix stored: a signed manifest with a file named `..`."""
    m = build_manifest(ckpt, policy_id=trainer.peer_id, version=1, shard_size=SHARD)
    fields = {**m.model_dump(), "files": [FileEntry(name="..", size=m.files[0].size),
                                          *m.files[1:]]}
    vdir = root / trainer.peer_id / f"{1:012d}"
    vdir.mkdir(parents=True)
    (vdir / "manifest.env").write_bytes(trainer.seal(CheckpointManifest.model_construct(
        **fields)))
    return vdir


def test_bad_stored_manifest_is_quarantined(tmp_path, ckpt, trainer):
    root = tmp_path / "broadcast"
    vdir = store_dotdot_manifest(root, trainer, ckpt)
    from swarm_node.node.broadcast.manifest import ManifestGate

    gate = ManifestGate.from_config([trainer.peer_id], BroadcastSection(), lambda p: -1)
    store = ShardStore(root)
    assert store.load(gate.problem) == []
    assert not vdir.exists()
    (moved,) = (root / QUARANTINE_DIR).iterdir()
    assert (moved / "manifest.env").is_file()
    assert ShardStore(root).load(gate.problem) == []  # and the next start is clean too


@pytest.mark.slow
async def test_node_with_a_dotdot_manifest_on_disk_starts(tmp_path, ckpt, trainer, procs):
    # issue 17.4: the node could not start any more (stored manifest reloaded, unhandled)
    vdir = store_dotdot_manifest(tmp_path / "f" / "broadcast", trainer, ckpt)
    f = procs("f", "inference", tmp_path / "f", "--follow", trainer.peer_id,
              log_level="WARNING")
    await f.ready()
    assert not vdir.exists()
    assert "quarantined" in f.stderr_tail(5000)
    assert (await stats(f))["held"] == []


# 17.3: who may publish a policy ---------------------------------------------------------


@pytest.mark.slow
async def test_only_the_chosen_trainer_is_followed_and_the_choice_sticks(tmp_path, procs):
    ckpt = make_checkpoint(tmp_path / "ckpt", {"model.safetensors": 300_000})
    evil_ckpt = make_checkpoint(tmp_path / "evil", {"model.safetensors": 200_000}, seed=9)
    trainer = procs("trainer", "trainer", tmp_path / "trainer")
    await trainer.ready()
    # an unknown key publishing checkpoints, reachable by everyone
    attacker = procs("attacker", "trainer", tmp_path / "attacker", *boot(trainer))
    await attacker.ready()
    fkey = tmp_path / "f.pem"
    Identity.generate().save(fkey)
    # no --follow: the follower asks its bootstrap peer, which names itself
    f = procs("f", "inference", tmp_path / "f", *boot(trainer), key=fkey, log_level="INFO")
    await f.ready()
    attacker.send(f"publish {evil_ckpt} 1")
    await attacker.event("published")
    trainer.send(f"publish {ckpt} 1")
    await trainer.event("published")
    done = await f.event("complete", timeout=90)
    assert done["policy"] == trainer.peer_id
    assert read_dir(Path(done["path"])) == read_dir(ckpt)
    s = await stats(f)
    assert s["follow"] == [trainer.peer_id]
    assert all(policy == trainer.peer_id for policy, _ in s["held"])
    # a trainer follows nobody unless configured: the attacker's version is refused
    t = await stats(trainer)
    assert [p for p, _ in t["held"]] == [trainer.peer_id]
    assert t["rejected"].get("not_followed", 0) >= 1
    assert json.loads((tmp_path / "f" / FOLLOW_FILE).read_text())["trainer"] == trainer.peer_id
    assert "following trainer " + trainer.peer_id in f.stderr_tail(20000)
    f.stop()
    # restarted through the attacker: the choice is kept, the attacker's v2 never adopted
    again = procs("f2", "inference", tmp_path / "f", *boot(attacker), key=fkey)
    await again.ready()
    attacker.send(f"publish {evil_ckpt} 2")
    await attacker.event("published")
    s = await stats(again)
    assert s["follow"] == [trainer.peer_id]

    async def rejected_attacker():
        st = await stats(again)
        return st["rejected"].get("not_followed", 0) >= 1 and st
    st = await wait_for(rejected_attacker, what="the attacker's v2 to be refused")
    assert all(policy == trainer.peer_id for policy, _ in st["held"])


# 17.6: advert poisoning -----------------------------------------------------------------


class GarbageServer:
    """A TCP "shard server" that answers every request with a valid header and garbage."""

    def __init__(self):
        self.connections = 0
        self.bytes_sent = 0

    async def handle(self, reader, writer):
        from swarm_node.node.broadcast.wire import FRAME_HEADER
        from swarm_node.protocol.messages import ShardResponseHeader

        self.connections += 1
        try:
            (n,) = FRAME_HEADER.unpack(await reader.readexactly(4))
            await reader.readexactly(min(n, 1024))
            header = ShardResponseHeader(ok=True, length=SHARD).encode()
            writer.write(FRAME_HEADER.pack(len(header)) + header)
            junk = b"\x5a" * SHARD
            writer.write(junk)
            self.bytes_sent += len(junk)
            await writer.drain()
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()


@pytest.mark.slow
async def test_sybil_adverts_cost_bounded_connections_and_bytes(tmp_path, procs):
    from swarm_node.node.p2p import P2PNode

    size = 2 * 2**20
    ckpt = make_checkpoint(tmp_path / "ckpt", {"model.safetensors": size})
    trainer = procs("trainer", "trainer", tmp_path / "trainer")
    await trainer.ready()
    f = procs("f", "inference", tmp_path / "f", "--follow", trainer.peer_id, *boot(trainer))
    await f.ready()
    garbage = GarbageServer()
    server = await asyncio.start_server(garbage.handle, "127.0.0.1", 0)
    endpoint = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    sybils = []
    try:
        for _ in range(6):  # each a real libp2p host with its own key (sender = origin)
            cfg = load_config(None, {"node.listen": ["/ip4/127.0.0.1/tcp/0"],
                                     "p2p.mesh_wait_s": 5})
            node = P2PNode(Identity.generate(), cfg)
            await node.start(bootstrap=trainer.addrs)
            await node.subscribe("adverts", lambda env, peer: None)
            sybils.append(node)
        trainer.send("rate 1")  # a slow honest source: sybil adverts land mid-download
        await trainer.event("rate")
        trainer.send(f"publish {ckpt} 1")
        await trainer.event("published")
        advert = ShardAdvert(policy_id=trainer.peer_id, version=1, complete=True,
                             endpoint=endpoint)

        async def flood():
            while True:
                await asyncio.gather(*(s.publish("adverts", advert) for s in sybils),
                                     return_exceptions=True)
                await asyncio.sleep(0.5)  # the flood's pace (a sybil re-adverts), not a wait
        flooder = asyncio.create_task(flood())
        try:
            done = await f.event("complete", timeout=120)
        finally:
            flooder.cancel()
        assert read_dir(Path(done["path"])) == read_dir(ckpt)
        s = await stats(f)
        assert s["counters"].get("adverts_not_admitted", 0) > 0
        cfg = BroadcastSection()
        # at most max_sources_per_host unproven sources per endpoint host, each used for
        # at most per_source_downloads shards before its first corrupt one drops it
        bound = cfg.max_sources_per_host * cfg.per_source_downloads
        assert garbage.connections <= bound, garbage.connections
        assert garbage.bytes_sent <= bound * SHARD
        assert done["metrics"]["bytes_fetched"] <= size + bound * SHARD
    finally:
        server.close()
        await asyncio.gather(*(s.close() for s in sybils), return_exceptions=True)


# 17.9: a disk that fills ----------------------------------------------------------------


def mount_tmpfs(mnt: Path, size: str) -> None:
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)],
                       check=False, capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")


@pytest.fixture
def small_fs(tmp_path):
    """A real 8 MiB tmpfs (needs root, as in CI's container); skipped where mounting is
    not allowed."""
    mnt = tmp_path / "small"
    mount_tmpfs(mnt, "8m")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.fixture
def trainer_fs(tmp_path):
    """A real 32 MiB tmpfs for a trainer's data dir (tiny model: ~1.6 MiB a checkpoint)."""
    mnt = tmp_path / "trainer-fs"
    mount_tmpfs(mnt, "32m")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def fill(fs: Path, leave: int) -> Path:
    """Write a filler file so that about `leave` bytes stay free."""
    filler = fs / "filler"
    with open(filler, "ab") as out:
        while (gap := shutil.disk_usage(fs).free - leave) > 0:
            try:  # in pieces: a node may be writing beside us
                out.write(b"\0" * min(gap, 1 << 20))
                out.flush()
            except OSError:  # full already: that is what we wanted
                break
    return filler


@pytest.mark.slow
async def test_disk_full_pauses_the_download_and_resumes(tmp_path, small_fs, procs):
    size = 3 * 2**20
    ckpt = make_checkpoint(tmp_path / "ckpt", {"model.safetensors": size, "config.json": 999})
    trainer = procs("trainer", "trainer", tmp_path / "trainer")
    await trainer.ready()
    f = procs("f", "inference", small_fs / "f", "--follow", trainer.peer_id, *boot(trainer),
              "--min-free-mib", "0", log_level="WARNING")
    await f.ready()
    trainer.send("rate 0.1")  # the first shards take seconds: the disk fills first
    await trainer.event("rate")
    trainer.send(f"publish {ckpt} 1")
    await trainer.event("published")
    f.send(f"offer {manifest_file(tmp_path / 'trainer', trainer.peer_id, 1)}")
    await f.event("accepted")
    filler = fill(small_fs, 64 * 1024)  # less than one shard left

    async def paused():
        s = await stats(f)
        return s["disk"]["paused"] and s
    await wait_for(paused, what="the download to pause for lack of space")
    assert f.proc.poll() is None  # still up
    assert "disk full" in f.stderr_tail(20000)
    filler.unlink()
    trainer.send("rate 0")
    await trainer.event("rate")
    done = await f.event("complete", timeout=90)
    assert read_dir(Path(done["path"])) == read_dir(ckpt)
    assert not (await stats(f))["disk"]["paused"]


@pytest.mark.slow
async def test_manifest_larger_than_the_free_disk_is_refused_then_taken(tmp_path, small_fs,
                                                                        procs):
    ckpt = make_checkpoint(tmp_path / "ckpt", {"model.safetensors": 2 * 2**20})
    trainer = procs("trainer", "trainer", tmp_path / "trainer")
    await trainer.ready()
    f = procs("f", "inference", small_fs / "f", "--follow", trainer.peer_id, *boot(trainer),
              "--min-free-mib", "1")
    await f.ready()
    filler = fill(small_fs, 2 * 2**20)  # the checkpoint fits, the margin does not
    trainer.send(f"publish {ckpt} 1")
    await trainer.event("published")

    async def refused():
        s = await stats(f)
        return s["rejected"].get("no_space", 0) >= 1 and s
    s = await wait_for(refused, what="a no_space rejection")
    assert s["disk"]["paused"] and s["held"] == []
    filler.unlink()  # space is back: the next advert of the trainer brings the version
    done = await f.event("complete", timeout=60)
    assert read_dir(Path(done["path"])) == read_dir(ckpt)


def group(i: int):
    """A buffer row of ~64 KiB (random text does not compress)."""
    import random

    from swarm_node.node.trainer.buffer import CompletionRecord, RolloutGroup

    text = random.Random(i).randbytes(32 * 1024).hex()
    return RolloutGroup("external", {"name": "toy/digit_successor", "index": i}, [1, 2, 3],
                        [CompletionRecord([4, 5], 1.0, text=text)], policy_id="p")


def test_buffer_on_a_full_disk_raises_disk_full_and_loses_nothing(small_fs):
    # issue 17.9: the trainer crashed; now the writer gets DiskFull, pauses and retries
    from swarm_node.node.diskspace import DiskFull, configure, margin
    from swarm_node.node.trainer.buffer import RolloutBuffer

    old = margin()
    configure(0)
    try:
        buf = RolloutBuffer(small_fs / "buffer.db")
        filler = fill(small_fs, 256 * 1024)
        added = 0
        with pytest.raises(DiskFull):
            for i in range(100):
                added += len(buf.add([group(i)]))
        assert 0 < added < 100 and buf.count() == added  # every acknowledged row is there
        filler.unlink()
        assert len(buf.add([group(1000)])) == 1
        assert buf.count() == added + 1
        buf.close()
    finally:
        configure(old)


@pytest.mark.slow
async def test_trainer_on_a_full_disk_pauses_and_resumes(tmp_path, trainer_fs):
    """A real `swarm-node join --role trainer` whose data dir fills: it stays up, says so
    in /status, and trains and publishes again once space is freed."""
    from swarm_node.node import demo
    from swarm_node.node.models import build_tiny_model

    model_dir = tmp_path / "model"
    build_tiny_model(model_dir, seed=0)
    node = demo.DemoNode("trainer", "trainer", trainer_fs / "trainer")
    cfg = demo.node_config(node, model_dir, [], [], "default")
    cfg["node"]["min_free_disk_mib"] = 1
    cfg["trainer"].update(peer_batches_per_step=0, peer_wait_s=0.5)
    start_demo_node(node, cfg)  # demo.start_node, forked warm
    try:
        demo.wait_info(node)

        async def status(pred, what):
            """The trainer process's /status once `pred` holds (read every 0.25 s)."""
            async def check():
                assert node.proc.poll() is None, demo.tail(node.log_path)
                s = await asyncio.to_thread(demo.fetch_status, node)
                return s if s and pred(s) else None
            return await async_wait_until(check, 180, what, interval=0.25,
                                          details=lambda: demo.tail(node.log_path))
        await status(lambda s: s.get("versions_published", 0) >= 2, "two versions")
        filler = fill(trainer_fs, 256 * 1024)
        await status(lambda s: s.get("extra", {}).get("disk", {}).get("paused"), "a pause")
        published = demo.fetch_status(node)["versions_published"]
        filler.unlink()
        s = await status(lambda s: s.get("versions_published", 0) > published + 1,
                         "training to resume")
        assert not s["extra"]["disk"]["paused"] and node.proc.poll() is None
        assert "disk full" in demo.tail(node.log_path, 400)
    finally:
        demo.stop_nodes([node])


# 30.5: a manifest with more shards than anyone accepts ------------------------------------


@pytest.mark.slow
async def test_a_120k_shard_manifest_is_refused_before_any_work(tmp_path, trainer, procs):
    """It cost a relay 117 CPU-s; now refused `too_many_shards` at the gate, counted, with
    nothing written and no download started (a real relay process)."""
    (tmp_path / "big.env").write_bytes(trainer.seal(huge_manifest(trainer.peer_id)))
    r = procs("r", "relay", tmp_path / "r", "--follow", trainer.peer_id)
    await r.ready()
    before = (await stats(r))["cpu_s"]
    r.send(f"offer {tmp_path / 'big.env'}")
    ev = await r.event("rejected")
    s = await stats(r)
    assert ev["reason"] == "too_many_shards" and s["rejected"] == {"too_many_shards": 1}
    assert s["counters"].get("downloads_started", 0) == 0 and s["held"] == []
    assert not (tmp_path / "r" / "broadcast" / trainer.peer_id).exists()
    assert s["cpu_s"] - before < 5  # decoding and the signature (~0.1 CPU-s here), no more
