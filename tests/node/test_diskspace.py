"""Disk-full recognition, and waits for space that pause the writer, resume it, and end at
the node's stop signal (a full disk never holds a Ctrl-C). The filesystem is real: a
margin larger than the disk makes every check fail, as on a full disk."""

from __future__ import annotations

import asyncio
import errno
import logging

import pytest
from safetensors import SafetensorError
from swarm_node.node import diskspace
from swarm_node.node.diskspace import (
    DiskFull,
    DiskWatch,
    WaitStopped,
    as_disk_full,
    is_disk_full,
    until_written,
)

from tests.waiting import async_wait_until

HANG_GUARD_S = 30.0


def test_disk_full_recognised_from_oserror_and_safetensors(tmp_path):
    assert is_disk_full(OSError(errno.ENOSPC, "No space left on device"))
    assert is_disk_full(OSError(errno.EDQUOT, "Disk quota exceeded"))
    assert not is_disk_full(OSError(errno.ENOENT, "No such file or directory"))
    # What safetensors raised when a real trainer's checkpoint filled a tmpfs mid-write.
    full = SafetensorError("Error while serializing: I/O error: No space left on device "
                           "(os error 28)")
    assert is_disk_full(full)
    assert not is_disk_full(SafetensorError("Error while serializing: (os error 2)"))
    assert not is_disk_full(ValueError("bad"))
    err = as_disk_full(full, tmp_path)
    assert isinstance(err, DiskFull) and "disk full" in str(err)


@pytest.fixture
def full_disk():
    """Every space check fails: the margin is larger than any disk."""
    saved = diskspace.margin()
    diskspace.configure(2**62)
    yield
    diskspace.configure(saved)


async def test_a_write_waiting_for_space_ends_at_the_stop_signal(tmp_path, full_disk, caplog):
    stop = asyncio.Event()
    watch = DiskWatch("sampling", tmp_path, poll_s=3600)  # only the stop can end the wait
    calls = []

    async def write():
        calls.append(1)
        raise OSError(errno.ENOSPC, "No space left on device")

    with caplog.at_level(logging.INFO, logger="swarm_node"):
        waiting = asyncio.create_task(until_written(watch, write, stop=stop))
        await async_wait_until(lambda: calls and watch.paused, HANG_GUARD_S, "the pause")
        stop.set()
        with pytest.raises(WaitStopped, match="sampling waited for disk space"):
            await asyncio.wait_for(waiting, HANG_GUARD_S)
    assert watch.status()["paused"] and watch.status()["name"] == "sampling"
    paused = [r for r in caplog.records if "disk full: sampling paused" in r.getMessage()]
    assert len(paused) == 1  # one line per pause, however long it waits
    assert await watch.wait_for_space(1, stop) is False  # set already: at once


async def test_the_nodes_own_stop_ends_a_wait_that_was_given_none(tmp_path, full_disk):
    stop = asyncio.Event()
    diskspace.configure(2**62, stop)  # what the runner does at start
    try:
        watch = DiskWatch("training writes", tmp_path, poll_s=3600)  # ended by the stop only

        async def write():
            raise DiskFull("full")

        waiting = asyncio.create_task(until_written(watch, write))  # no stop passed
        await async_wait_until(lambda: watch.paused, HANG_GUARD_S, "the pause")
        stop.set()
        with pytest.raises(WaitStopped):
            await asyncio.wait_for(waiting, HANG_GUARD_S)
    finally:
        diskspace.configure(2**62, None)


async def test_a_paused_write_resumes_when_space_returns(tmp_path, full_disk, caplog):
    watch = DiskWatch("sampling", tmp_path, poll_s=0.05)
    attempts = []

    async def write():
        attempts.append(1)
        if diskspace.margin() > 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        return "written"

    with caplog.at_level(logging.INFO, logger="swarm_node"):
        waiting = asyncio.create_task(until_written(watch, write, stop=asyncio.Event()))
        await async_wait_until(lambda: watch.paused, HANG_GUARD_S, "the pause")
        diskspace.configure(0)  # space is back
        assert await asyncio.wait_for(waiting, HANG_GUARD_S) == "written"
    assert not watch.paused and watch.status()["paused"] is False
    text = [r.getMessage() for r in caplog.records]
    assert sum("sampling paused" in t for t in text) == 1
    assert sum("sampling resumed" in t for t in text) == 1


class Watched(DiskWatch):
    """A DiskWatch that counts its space checks (hits while waiting) and resumes."""

    def __init__(self, *a, **kw):
        self.hits = self.resumes = 0
        super().__init__(*a, **kw)

    def hit(self, e):
        self.hits += 1
        super().hit(e)

    def resumed(self):
        self.resumes += 1
        super().resumed()


async def test_a_retry_waits_for_the_space_the_failed_write_needs(tmp_path):
    """A write that needs more than is free (a checkpoint after its partial file was removed:
    a few MiB back, not the checkpoint's size) is not retried, and the writer not shown
    resumed, until that much is free. It used to be retried (and shown resumed) as soon as
    the margin was free."""
    saved = diskspace.margin()
    diskspace.configure(0)  # the margin alone is free at every check
    try:
        stop = asyncio.Event()
        watch = Watched("training writes", tmp_path, poll_s=0.01)
        attempts = []

        async def write():
            attempts.append(watch.paused)
            raise DiskFull("checkpoint: no room", path=tmp_path, need=2**62)

        waiting = asyncio.create_task(until_written(watch, write, stop=stop))
        await async_wait_until(lambda: watch.hits >= 10, HANG_GUARD_S, "ten space checks")
        assert attempts == [False] and watch.paused and watch.resumes == 0
        stop.set()
        with pytest.raises(WaitStopped):
            await asyncio.wait_for(waiting, HANG_GUARD_S)
    finally:
        diskspace.configure(saved)


async def test_the_writer_shows_resumed_only_once_a_write_succeeds(tmp_path, caplog):
    """Space comes back (the check passes) but the retried write fails again: the writer
    stays paused, one 'paused' line and one 'resumed' line in all, when the write is done."""
    saved = diskspace.margin()
    diskspace.configure(0)
    try:
        watch = DiskWatch("sampling", tmp_path, poll_s=0.01)
        seen_paused = []

        async def write():
            seen_paused.append(watch.paused)
            if len(seen_paused) < 3:
                raise OSError(errno.ENOSPC, "No space left on device")
            return "written"

        with caplog.at_level(logging.INFO, logger="swarm_node"):
            done = await asyncio.wait_for(until_written(watch, write, stop=asyncio.Event()),
                                          HANG_GUARD_S)
        assert done == "written" and seen_paused == [False, True, True]
        assert not watch.paused
        text = [r.getMessage() for r in caplog.records]
        assert sum("sampling paused" in t for t in text) == 1
        assert sum("sampling resumed" in t for t in text) == 1
    finally:
        diskspace.configure(saved)
