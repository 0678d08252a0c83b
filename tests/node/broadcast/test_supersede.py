"""A follower whose download of a version takes longer than the trainer's interval between
versions still completes versions (heal47): a download that superseded an unfinished one
runs to its end; the newest version announced meanwhile waits and starts after it.

Before, every newer version cancelled the unfinished one: in the 10-node WAN run (c47 b)
the cone peer on the longest path (~200 ms RTT) needed 3-4 s a version while the trainer
published one every 1.4-2.3 s, and completed none for 48.5 s (v105, then v140, only
because the trainer's next version came 3.9 s later). Over real libp2p hosts on 127.0.0.1;
the trainer's uploads are rate-limited so that a download takes a few seconds."""

from __future__ import annotations

import asyncio
import time

from swarm_node.node.broadcast import follower as follower_module
from swarm_node.node.broadcast.follower import KEEP_STALL_S
from swarm_node.node.broadcast.server import RateLimiter, ShardServer
from swarm_node.node.broadcast.store import ShardStore
from swarm_node.node.broadcast.transport import TcpTransport, serve_tcp
from swarm_node.node.broadcast.wire import fetch
from swarm_node.node.config import BroadcastSection
from swarm_node.protocol.messages import ShardRequest

from .conftest import make_checkpoint, node_config, publish, until

CKPT = {"model.safetensors": 470_000}  # ~4.5 s a download at 0.1 MiB/s


def _job(follower, tid):
    return follower.follower.jobs.get(tid)


def _verified(follower, tid, version) -> bool:
    job = _job(follower, tid)
    return (job is not None and job.version == version and job.downloader is not None
            and len(job.downloader.entry.have) >= 1)


def _known(follower, tid, version) -> bool:
    """The follower took `version`: downloading it, or holding it to start next."""
    f = follower.follower
    waiting = getattr(f, "waiting", {}).get(tid)
    job = f.jobs.get(tid)
    return ((waiting is not None and waiting.manifest.version == version)
            or (job is not None and job.version == version))


class Throttle(RateLimiter):
    """100 B/s (a 32 KiB chunk waits 327 s): the trainer's uploads all but stop. `asked`
    is set once an upload waits on it."""

    def __init__(self):
        super().__init__(100)
        self.asked = asyncio.Event()

    async def acquire(self, n: int) -> None:
        self.asked.set()
        await super().acquire(n)


async def _trainer_and_follower(tmp_path, swarm, **overrides):
    cfg = node_config(broadcast__upload_rate_mib_s=0.1, **overrides)
    tnode, trainer = await swarm("trainer", "trainer", cfg=cfg)
    _fnode, follower = await swarm("follower", "inference", follow=[tnode.peer_id],
                                   bootstrap=tnode.listen_addrs)
    ckpts = {v: make_checkpoint(tmp_path / f"ckpt{v}", CKPT, seed=v) for v in range(1, 5)}

    async def publish_version(v):
        await trainer.publish(ckpts[v], version=v)
    return tnode.peer_id, trainer, follower, publish_version


async def test_versions_faster_than_a_download_still_complete(tmp_path, swarm):
    tid, _trainer, follower, publish_version = await _trainer_and_follower(tmp_path, swarm)
    await publish_version(1)
    await until(lambda: _verified(follower, tid, 1), what="v1 under way")
    await publish_version(2)  # supersedes v1 (v1 superseded nothing)
    await until(lambda: _verified(follower, tid, 2), what="v2 under way")
    await publish_version(3)  # v2 superseded v1: it runs to its end; v3 waits
    await until(lambda: _known(follower, tid, 3), what="v3 known")
    await publish_version(4)  # ... and v4 takes v3's place
    await until(lambda: _known(follower, tid, 4), what="v4 known")
    assert _job(follower, tid).version == 2
    await follower.done.wait(tid, 4)
    assert (tid, 2) in follower.done.got  # before: cancelled by v3, never completed
    assert (tid, 3) not in follower.done.got  # the newest waiting one started, not v3
    c = follower.counters()
    assert c["downloads_superseded"] == 1
    assert c["downloads_completed"] == 2
    assert c["downloads_deferred"] == 2


async def test_a_version_that_waited_is_kept_too(tmp_path, swarm, monkeypatch):
    """The version that waited behind a kept download starts kept: the next version waits
    for it in turn. Before (swarm49), it started unkept and the next version cancelled it:
    the slowest follower of the 10-node runs (heal48) completed every other download it
    started. The trainer's uploads are throttled while a version is announced, so that no
    download ends in between (KEEP_STALL_S raised: the throttle is no stall here)."""
    tid, trainer, follower, publish_version = await _trainer_and_follower(
        tmp_path, swarm, broadcast__chunk_timeout_s=2)
    f = follower.follower
    monkeypatch.setattr(follower_module, "KEEP_STALL_S", 1e9)
    limiter = trainer.server.limiter

    async def announce_while_throttled(v):
        trainer.server.limiter = Throttle()
        await publish_version(v)
        await until(lambda: _known(follower, tid, v), what=f"v{v} known")
        trainer.server.limiter = limiter

    await publish_version(1)
    await until(lambda: _verified(follower, tid, 1), what="v1 under way")
    await announce_while_throttled(2)  # supersedes v1: kept
    await until(lambda: _verified(follower, tid, 2), what="v2 under way")
    await announce_while_throttled(3)  # waits for v2
    assert _job(follower, tid).version == 2 and f.waiting[tid].manifest.version == 3
    await until(lambda: _verified(follower, tid, 3), timeout=60, what="v3 under way")
    assert _job(follower, tid).kept  # it waited for v2
    await announce_while_throttled(4)
    assert _job(follower, tid).version == 3  # before: cancelled by v4
    assert f.waiting[tid].manifest.version == 4
    await follower.done.wait(tid, 4)
    assert {(tid, 2), (tid, 3), (tid, 4)} <= set(follower.done.got)
    c = follower.counters()
    assert c["downloads_superseded"] == 1 and c["downloads_deferred"] == 2
    assert c["downloads_completed"] == 3


async def test_a_stalled_download_is_still_superseded(tmp_path, swarm, monkeypatch):
    """A download that superseded another but verified nothing for KEEP_STALL_S (its
    sources gone: a partition) does not hold the newest version back until its stall
    timeout (the h47 run: 120 s, a 104 s heal). The trainer stays throttled until the
    follower took the newest version (a v2 that resumed first would rightly keep it
    waiting), then serves again at its old pace: v3 completes, then v4.

    And a version deferred behind v3 while the superseded v2 still unwinds (held here;
    its streams closing take up to CLOSE_TIMEOUT_S) stays deferred: before (heal48), v2
    took it with it when it ended, and it never started."""
    tid, trainer, follower, publish_version = await _trainer_and_follower(
        tmp_path, swarm, broadcast__chunk_timeout_s=2)
    f = follower.follower
    download, unwound = f._download, asyncio.Event()

    async def held_unwind(accepted):
        try:
            await download(accepted)
        except asyncio.CancelledError:
            if accepted.manifest.version == 2:
                await unwound.wait()
            raise
    f._download = held_unwind

    await publish_version(1)
    await until(lambda: _verified(follower, tid, 1), what="v1 under way")
    await publish_version(2)  # supersedes v1: v2 is kept while it makes progress
    await until(lambda: _verified(follower, tid, 2), what="v2 under way")
    limiter = trainer.server.limiter
    trainer.server.limiter = Throttle()
    v2 = _job(follower, tid)
    await until(lambda: time.monotonic() - v2.downloader.last_progress > KEEP_STALL_S + 0.5,
                timeout=60, what="v2 stalled")
    await publish_version(3)
    await until(lambda: _known(follower, tid, 3), what="v3 known")
    assert _job(follower, tid).version == 3  # superseded the stalled v2, did not wait

    monkeypatch.setattr(follower_module, "KEEP_STALL_S", 1e9)  # v3 is kept, stalled or not
    await publish_version(4)
    await until(lambda: _known(follower, tid, 4), what="v4 known")
    assert _job(follower, tid).version == 3 and f.waiting[tid].manifest.version == 4
    assert not v2.task.done()  # v2 still unwinding
    unwound.set()
    await asyncio.wait({v2.task}, timeout=30)
    assert v2.task.cancelled()
    assert f.waiting[tid].manifest.version == 4  # before: popped by v2 as it ended

    trainer.server.limiter = limiter
    await follower.done.wait(tid, 4)
    assert (tid, 3) in follower.done.got and (tid, 2) not in follower.done.got
    c = follower.counters()
    assert c["downloads_superseded"] == 2 and c["downloads_deferred"] == 1


async def test_uploads_asleep_in_the_limiter_give_their_slot_back(tmp_path, trainer):
    """A superseded download closes its transfers; the trainer's uploads to it that wait
    on the upload limiter are cut within `chunk_timeout_s` (the pace counts in the take
    window) and give back their slot and their tokens. Before (heal48), each slept as long
    as the limiter's debt said: throttled to 100 B/s, a follower's 4 uploads held its 4
    slots for 327-1310 s, and its next version got only `busy` answers (the CI failure of
    test_a_stalled_download_is_still_superseded)."""
    shard = 1024 * 1024
    ckpt = make_checkpoint(tmp_path / "ckpt", {"model.safetensors": shard})
    cfg = BroadcastSection(shard_size=shard, min_shard_size=4096, chunk_size=16 * 1024,
                           chunk_timeout_s=1.0)
    acc = publish(trainer, ckpt, 1, shard)
    store = ShardStore(tmp_path / "trainer")
    store.add_checkpoint(acc, ckpt)
    server = ShardServer(store, cfg)
    server.limiter = RateLimiter(256 * 1024)  # the whole shard in ~4 s
    tcp = await serve_tcp(server.serve_connection)
    source = f"127.0.0.1:{tcp.sockets[0].getsockname()[1]}"
    req = ShardRequest(policy_id=acc.manifest.policy_id, version=1, shard=0)
    upload = fetch(TcpTransport(), source, req, expected_len=shard, request_timeout=5,
                   chunk_timeout=30, chunk_size=cfg.chunk_size)
    try:
        assert await anext(upload)  # under way
        throttle = server.limiter = Throttle()
        await asyncio.wait_for(throttle.asked.wait(), 15)  # its next chunk waits 163 s
        await upload.aclose()  # superseded: the follower is gone
        await until(lambda: not server.active, 15, "the upload's slot given back")
        assert server.active_total == 0
        assert server.metrics["upload_stalled"] == 1
        assert throttle.tokens >= 0  # the cut chunk's tokens given back
    finally:
        await upload.aclose()
        tcp.close()
