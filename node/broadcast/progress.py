"""Download progress: a rich bar in an interactive terminal, a log line otherwise."""

from __future__ import annotations

import logging
import sys
import time

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, TimeRemainingColumn, TransferSpeedColumn
from rich.progress import Progress as RichProgress

log = logging.getLogger(__name__)
LOG_EVERY_S = 5.0


class Progress:
    def __init__(self, label: str, total_bytes: int, *, interactive: bool | None = None):
        self.label, self.total = label, total_bytes
        self.done = 0
        self.start = self.last_log = time.monotonic()
        interactive = sys.stderr.isatty() if interactive is None else interactive
        self._bar = self._task = None
        if interactive:
            self._bar = RichProgress("[bold]{task.description}", BarColumn(), DownloadColumn(),
                                     TransferSpeedColumn(), TimeRemainingColumn(),
                                     console=Console(stderr=True), transient=True)
            self._bar.start()
            self._task = self._bar.add_task(label, total=total_bytes, completed=0)

    def advance(self, nbytes: int) -> None:
        self.done += nbytes
        if self._bar is not None:
            self._bar.update(self._task, completed=self.done)
            return
        now = time.monotonic()
        if now - self.last_log >= LOG_EVERY_S:
            self.last_log = now
            log.info("%s: %.1f/%.1f MiB (%.0f%%), %.1f MiB/s", self.label, self.done / 2**20,
                     self.total / 2**20, 100 * self.done / max(self.total, 1),
                     self.done / 2**20 / max(now - self.start, 1e-6))

    def close(self, ok: bool = True) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
        secs = time.monotonic() - self.start
        log.info("%s: %s, %.1f MiB in %.1fs", self.label, "complete" if ok else "stopped",
                 self.done / 2**20, secs)
