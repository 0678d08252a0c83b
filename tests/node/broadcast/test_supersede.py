"""A follower whose download of a version takes longer than the trainer's interval between
versions still completes versions (heal47): a download that superseded an unfinished one
runs to its end; the newest version announced meanwhile waits and starts after it.

Before, every newer version cancelled the unfinished one: in the 10-node WAN run (c47 b)
the cone peer on the longest path (~200 ms RTT) needed 3-4 s a version while the trainer
published one every 1.4-2.3 s, and completed none for 48.5 s (v105, then v140, only
because the trainer's next version came 3.9 s later). Over real libp2p hosts on 127.0.0.1;
the trainer's uploads are rate-limited so that a download takes a few seconds."""

from __future__ import annotations

import time

from swarm_node.node.broadcast.follower import KEEP_STALL_S
from swarm_node.node.broadcast.server import RateLimiter

from .conftest import make_checkpoint, node_config, until


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


async def test_versions_faster_than_a_download_still_complete(tmp_path, swarm):
    # ~470 KiB a version at 0.1 MiB/s: ~4.5 s a download
    cfg = node_config(broadcast__upload_rate_mib_s=0.1)
    tnode, trainer = await swarm("trainer", "trainer", cfg=cfg)
    tid = tnode.peer_id
    _fnode, follower = await swarm("follower", "inference", follow=[tid],
                                   bootstrap=tnode.listen_addrs)

    async def publish(v):
        ckpt = make_checkpoint(tmp_path / f"ckpt{v}", {"model.safetensors": 470_000}, seed=v)
        await trainer.publish(ckpt, version=v)

    await publish(1)
    await until(lambda: _verified(follower, tid, 1), what="v1 under way")
    await publish(2)  # supersedes v1 (v1 superseded nothing)
    await until(lambda: _verified(follower, tid, 2), what="v2 under way")
    await publish(3)  # v2 superseded v1: it runs to its end; v3 waits
    await until(lambda: _known(follower, tid, 3), what="v3 known")
    await publish(4)  # ... and v4 takes v3's place
    await until(lambda: _known(follower, tid, 4), what="v4 known")
    assert _job(follower, tid).version == 2
    await follower.done.wait(tid, 4)
    assert (tid, 2) in follower.done.got  # before: cancelled by v3, never completed
    assert (tid, 3) not in follower.done.got  # the newest waiting one started, not v3
    c = follower.counters()
    assert c["downloads_superseded"] == 1
    assert c["downloads_completed"] == 2
    assert c["downloads_deferred"] == 2


async def test_a_stalled_download_is_still_superseded(tmp_path, swarm):
    """A download that superseded another but verified nothing for KEEP_STALL_S (its
    sources gone: a partition) does not hold the newest version back until its stall
    timeout (the h47 run: 120 s, a 104 s heal)."""
    cfg = node_config(broadcast__upload_rate_mib_s=0.1)
    tnode, trainer = await swarm("trainer", "trainer", cfg=cfg)
    tid = tnode.peer_id
    _fnode, follower = await swarm("follower", "inference", follow=[tid],
                                   bootstrap=tnode.listen_addrs)

    async def publish(v):
        ckpt = make_checkpoint(tmp_path / f"ckpt{v}", {"model.safetensors": 470_000}, seed=v)
        await trainer.publish(ckpt, version=v)

    await publish(1)
    await until(lambda: _verified(follower, tid, 1), what="v1 under way")
    await publish(2)  # supersedes v1: v2 is kept while it makes progress
    await until(lambda: _verified(follower, tid, 2), what="v2 under way")
    limiter = trainer.server.limiter
    trainer.server.limiter = RateLimiter(100)  # the trainer's uploads all but stop
    job = _job(follower, tid)
    await until(lambda: time.monotonic() - job.downloader.last_progress > KEEP_STALL_S + 0.5,
                timeout=60, what="v2 stalled")
    trainer.server.limiter = limiter
    await publish(3)
    await until(lambda: _known(follower, tid, 3), what="v3 known")
    assert _job(follower, tid).version == 3  # superseded the stalled v2, did not wait
    await follower.done.wait(tid, 3)
