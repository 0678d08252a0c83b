"""Free disk space: a check before each large write, and a shared "paused: disk full" state.

A node writes checkpoints, shards, the rollout buffer, the reputation and round counters.
When the disk fills, none of that may crash the node or lose data it already accepted: the
writer checks space first (`ensure_free`), a failed write is recognised (`is_disk_full`),
and the work that writes pauses (`DiskWatch.wait_for_space`) until space returns, while the
node keeps serving. `DiskWatch.status()` is what /status shows (`extra.disk`).

The margin (bytes that must stay free after a write) is set once at start from
`node.min_free_disk_mib` (`configure`); writers that have no config at hand use it. So is the
node's stop signal: a write waiting for space (`until_written`) gives up when the node is
asked to stop (`WaitStopped`), so a full disk never holds a Ctrl-C.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import shutil
import time
from pathlib import Path

from .errors import NodeError

log = logging.getLogger(__name__)

DISK_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT}
_margin = 256 * 2**20  # set by configure(); bytes that must stay free after a write
_stop: asyncio.Event | None = None  # set by configure(); the node's stop signal


class DiskFull(NodeError):
    """Not enough free space for a write (checked before writing, or ENOSPC from the OS)."""

    reason = "disk_full"

    def __init__(self, message: str, *, path: Path | str = "", need: int = 0, free: int = 0):
        super().__init__(message)
        self.path, self.need, self.free = str(path), need, free


class WaitStopped(NodeError):
    """The node was asked to stop while a write waited for disk space: the write did not
    happen (the caller's work item is abandoned, as at any stop)."""

    reason = "stopped"


def configure(min_free_bytes: int, stop: asyncio.Event | None = None) -> None:
    """Set the margin every check keeps free (from `node.min_free_disk_mib`) and the node's
    stop signal, which ends every `until_written` wait."""
    global _margin, _stop
    _margin = max(0, int(min_free_bytes))
    _stop = stop


def margin() -> int:
    return _margin


def free_bytes(path: Path | str) -> int:
    """Free bytes (for an unprivileged writer) on the filesystem holding `path`, or the
    nearest existing parent when `path` does not exist yet."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return shutil.disk_usage(p).free


def ensure_free(path: Path | str, need: int, keep: int | None = None) -> None:
    """Raise DiskFull unless `need` more bytes fit under `path` with `keep` (default: the
    configured margin) still free afterwards."""
    keep = _margin if keep is None else keep
    free = free_bytes(path)
    if free - max(0, need) < keep:
        raise DiskFull(f"{path}: {_mib(need)} to write, {_mib(free)} free, {_mib(keep)} must "
                       f"stay free", path=path, need=need, free=free)


def is_disk_full(e: BaseException) -> bool:
    """True for our DiskFull and for an OSError saying the disk or quota is full."""
    if isinstance(e, DiskFull):
        return True
    if isinstance(e, OSError):
        return e.errno in DISK_FULL_ERRNOS
    # Rust writers (safetensors' SafetensorError) report the OS error only in their message.
    return any(f"(os error {n})" in str(e) for n in DISK_FULL_ERRNOS)


def as_disk_full(e: BaseException, path: Path | str, need: int = 0) -> DiskFull:
    """A disk-full error (see is_disk_full) as a DiskFull naming the path."""
    free = free_bytes(path)
    code = e.errno if isinstance(e, OSError) and e.errno else errno.ENOSPC
    return DiskFull(f"{path}: disk full ({os.strerror(code)}), {_mib(free)} free",
                    path=path, need=need, free=free)


class DiskWatch:
    """Whether the writes of one component are paused for lack of space, and waiting until
    they fit again. Logs one line when it pauses and one when it resumes."""

    def __init__(self, name: str, path: Path | str, poll_s: float = 1.0):
        self.name, self.path, self.poll_s = name, Path(path), poll_s
        self.paused = False
        self.detail = ""
        self.since = 0.0
        self.pauses = 0
        self.view: dict = {}  # live, for /status (the same dict object, updated in place)
        self._update()

    def _update(self) -> None:
        self.view.update(name=self.name, paused=self.paused, detail=self.detail,
                         pauses=self.pauses, path=str(self.path),
                         since=round(self.since, 1) if self.paused else None,
                         min_free_bytes=_margin)

    def hit(self, e: BaseException) -> None:
        """Record a disk-full failure (pauses the writer; logs once per pause)."""
        if not self.paused:
            self.paused, self.since = True, time.time()
            self.pauses += 1
            log.warning("disk full: %s paused (%s); the node keeps running and resumes when "
                        "space is freed", self.name, e)
        self.detail = str(e)
        self._update()

    def resumed(self) -> None:
        if self.paused:
            log.info("disk space back: %s resumed after %.0fs", self.name,
                        time.time() - self.since)
        self.paused, self.detail = False, ""
        self._update()

    async def wait_for_space(self, need: int, stop: asyncio.Event | None = None) -> bool:
        """Wait until `need` bytes fit, then count the writer resumed; False as soon as
        `stop` is set (at once, not at the next check). Free space is looked at every
        `poll_s`: nothing signals that a filesystem gained space (an operator deletes files,
        another process ends), so an interval is how to see it. Without `stop` only
        cancelling the task ends the wait."""
        if not await self.until_space(need, stop):
            return False
        self.resumed()
        return True

    async def until_space(self, need: int, stop: asyncio.Event | None) -> bool:
        """Wait until `need` bytes fit, still paused (the writer's retry says whether it
        resumed); False as soon as `stop` is set."""
        while True:
            try:
                ensure_free(self.path, need)
            except DiskFull as e:
                self.hit(e)
            else:
                return True
            if await _stopped_within(stop, self.poll_s):
                return False

    def status(self) -> dict:
        """A live view for /status: `paused` (writes waiting for space), `detail`."""
        return self.view


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


async def until_written(watch: DiskWatch, call, *args, need: int = 0,
                        stop: asyncio.Event | None = None, **kwargs):
    """`await call(*args, **kwargs)`, and while it fails because the disk is full: pause
    (logged once, shown in /status through `watch`), wait for space, and try again. For
    writes that must not be lost (buffer, checkpoint, counters): the caller's work pauses,
    the node stays up. The retry waits until the space the failed write said it needs
    (`DiskFull.need`, else `need`) is free, and the writer counts as resumed only once a
    write succeeds: a few freed MiB (a partial checkpoint removed) neither start a retry
    bound to fail nor show the node resumed while its writes still fail. Raises
    WaitStopped as soon as `stop` (default: the node's, `configure`) is set while it
    waits: the write did not happen."""
    stop = stop if stop is not None else _stop
    while True:
        try:
            result = await call(*args, **kwargs)
        except (OSError, DiskFull) as e:
            if not is_disk_full(e):
                raise
            watch.hit(e)
            wanted = max(need, e.need if isinstance(e, DiskFull) else 0)
            # one check interval first: the write itself found the disk full just now
            if (await _stopped_within(stop, watch.poll_s)
                    or not await watch.until_space(wanted, stop)):
                raise WaitStopped(f"stopped while {watch.name} waited for disk space "
                                  f"({watch.detail})") from None
            continue
        watch.resumed()
        return result


async def _stopped_within(stop: asyncio.Event | None, seconds: float) -> bool:
    """Wait one check interval; True (at once) if `stop` is or becomes set."""
    if stop is None:
        await asyncio.sleep(seconds)
        return False
    if stop.is_set():
        return True
    try:
        async with asyncio.timeout(seconds):
            await stop.wait()
    except TimeoutError:
        return False
    return True
