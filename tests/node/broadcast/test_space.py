"""Disk space for concurrent downloads is reserved, not just checked (issue 30.5), with real
processes on a real, small filesystem: two followed trainers announce versions that each
fit the free space but not together; one is taken, the other refused `no_space`, and the
one taken never runs into the margin."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from .conftest import boot, make_checkpoint, read_dir
from .test_hostile import fill, small_fs, stats, wait_for

__all__ = ["small_fs"]  # the fixture


@pytest.mark.slow
async def test_two_trainers_versions_that_fit_only_one_at_a_time(tmp_path, small_fs, procs):
    size = 3 * 2**20
    t1 = procs("t1", "trainer", tmp_path / "t1")
    await t1.ready()
    t2 = procs("t2", "trainer", tmp_path / "t2", *boot(t1))
    await t2.ready()
    f = procs("f", "inference", small_fs / "f", "--follow", t1.peer_id, "--follow", t2.peer_id,
              *boot(t1, t2), "--min-free-mib", "1", log_level="INFO")
    await f.ready()
    filler = fill(small_fs, int(5.5 * 2**20))  # 3 MiB + the 1 MiB margin fits, twice not
    for t in (t1, t2):
        t.send("rate 1")  # the first download is still running when the second arrives
        await t.event("rate")
    for i, t in enumerate((t1, t2)):
        ckpt = make_checkpoint(tmp_path / f"ckpt{i}", {"model.safetensors": size}, seed=i)
        t.send(f"publish {ckpt} 1")
        await t.event("published")
    done = await f.event("complete", timeout=90)
    ckpt = tmp_path / f"ckpt{0 if done['policy'] == t1.peer_id else 1}"
    assert read_dir(Path(done["path"])) == read_dir(ckpt)

    async def refused():
        s = await stats(f)
        return s["rejected"].get("no_space", 0) >= 1 and s
    s = await wait_for(refused, what="the other version refused for lack of space")
    assert [policy for policy, _ in s["held"]] == [done["policy"]]
    assert s["counters"]["downloads_started"] == 1
    assert s["counters"].get("disk_full_pauses", 0) == 0  # the one taken never stalled
    assert shutil.disk_usage(small_fs).free >= 2**20  # the margin was kept
    filler.unlink()


async def test_a_superseded_download_releases_its_reservation(tmp_path, swarm):
    """A version superseded before its download even ran holds no space afterwards, and a
    finished download none either (the reservations are what later manifests are checked
    against)."""
    ckpt = make_checkpoint(tmp_path / "ckpt", {"model.safetensors": 300_000})
    tnode, trainer = await swarm("trainer", "trainer")
    tid = tnode.peer_id
    _fnode, follower = await swarm("follower", "inference", bootstrap=tnode.listen_addrs)
    for v in (1, 2):
        m = await trainer.publish(ckpt, version=v)
    sealed = [trainer.store.get(tid, v).envelope for v in (1, 2)]
    follower.gate.follow_policy(tid)  # from now on: nothing started by gossip before
    follower.accept_bytes(sealed[0])
    follower.accept_bytes(sealed[1])  # same tick: v1's task never ran
    assert follower.follower.space.total == m.total_size
    await follower.done.wait(tid, 2)
    assert follower.follower.space.total == 0
    assert follower.counters()["downloads_superseded"] >= 1
