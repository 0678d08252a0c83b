"""Progress of long work, as operators see it (issue 29.6).

`StepProgress`: the trainer's step in progress, for `/status` (`extra["step"]`), the
dashboard and `swarm-node status`: what the loop does now and what it waits for, the groups
gathered of the batch a step takes (I local + J external), and when the next version is
due, from the pace of the recent steps.

`ItemProgress`: a long loop over items (a held-out evaluation): one log line every
`LOG_EVERY_S` with the count done, the rate and an ETA, and its state for a view.

`Stage`: a long start-up stage that reports no progress of its own (loading the model): the
time so far and an ETA from the same stage's duration in the previous run.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

log = logging.getLogger(__name__)

PACE_STEPS = 8
"""Recent intervals between versions the pace (and so the ETA) is the mean of."""
LOG_EVERY_S = 5.0
T = TypeVar("T")


class StepProgress:
    """`set(phase, doing)` at each stage of the trainer loop, `stepped(version)` after each
    step that made a version; `refresh()` (before each /status read) writes `view`.
    `groups()` -> (local, external) groups waiting in the buffer; `need` = (I, J)."""

    def __init__(self, need: tuple[int, int], groups: Callable[[], tuple[int, int]],
                 version: int, clock: Callable[[], float] = time.monotonic):
        self.need, self.groups, self.clock = need, groups, clock
        self.version = version
        self.view: dict = {}
        self._intervals: deque[float] = deque(maxlen=PACE_STEPS)
        self._last: float | None = None  # when the newest version was made (this run)
        self._phase, self._doing = "starting", "starting up"
        self._since = clock()

    def set(self, phase: str, doing: str | Callable[[], str]) -> None:
        """What the loop does now (`doing`: a line, or a function of the moment, e.g. a
        count of batches that grows while it waits)."""
        if phase != self._phase:
            self._since = self.clock()
        self._phase, self._doing = phase, doing

    def stepped(self, version: int) -> None:
        now = self.clock()
        if self._last is not None:
            self._intervals.append(now - self._last)
        self._last, self.version = now, version

    @property
    def pace_s(self) -> float | None:
        """Mean seconds between the recent versions (None before two in this run)."""
        return sum(self._intervals) / len(self._intervals) if self._intervals else None

    def eta_s(self) -> float | None:
        """Seconds until the next version is due at the recent pace (0: overdue)."""
        pace = self.pace_s
        if pace is None or self._last is None:
            return None
        return max(0.0, self._last + pace - self.clock())

    def refresh(self) -> None:
        local, external = self.groups()
        doing = self._doing() if callable(self._doing) else self._doing
        eta, pace = self.eta_s(), self.pace_s
        self.view.clear()
        self.view.update({
            "next_version": self.version + 1, "phase": self._phase, "doing": doing,
            "phase_s": round(self.clock() - self._since, 1),
            "groups": {"local": local, "external": external, "need_local": self.need[0],
                       "need_external": self.need[1]},
            "pace_s": None if pace is None else round(pace, 1),
            "eta_s": None if eta is None else round(eta, 1)})


class ItemProgress:
    """`advance(n)` after each chunk of a `total`-item job; a line every LOG_EVERY_S
    (`label: done/total (pct), rate/s, ETA`) and one at `close()`, said by `say` (default:
    logged at INFO; a command that prints its output passes `print`)."""

    def __init__(self, label: str, total: int, unit: str = "items",
                 clock: Callable[[], float] = time.monotonic,
                 say: Callable[[str], None] | None = None):
        self.label, self.total, self.unit, self.clock = label, total, unit, clock
        self.say = say or (lambda line: log.info("%s", line))
        self.done = 0
        self.start = self.last_log = clock()

    def eta_s(self) -> float | None:
        elapsed = self.clock() - self.start
        if self.done <= 0 or elapsed <= 0:
            return None
        return max(0, self.total - self.done) * elapsed / self.done

    def view(self) -> dict:
        eta = self.eta_s()
        return {"label": self.label, "done": self.done, "total": self.total,
                "unit": self.unit, "eta_s": None if eta is None else round(eta, 1)}

    def advance(self, n: int) -> None:
        self.done += n
        now = self.clock()
        if now - self.last_log >= LOG_EVERY_S and self.done < self.total:
            self.last_log = now
            eta = self.eta_s()
            self.say(f"{self.label}: {self.done}/{self.total} {self.unit} "
                     f"({100 * self.done / max(self.total, 1):.0f}%), "
                     f"{self.done / max(now - self.start, 1e-6):.1f}/s, ETA {duration(eta)}")

    def close(self) -> None:
        self.say(f"{self.label}: {self.done} {self.unit} in {self.clock() - self.start:.1f} s")


def duration(seconds: float | None) -> str:
    """`12 s`, `3 min`, `2 h 5 min`; `?` when not known."""
    if seconds is None:
        return "?"
    s = int(seconds)
    if s < 120:
        return f"{s} s"
    if s < 7200:
        return f"{s // 60} min"
    return f"{s // 3600} h {s % 3600 // 60} min"


STAGES_FILE = "stages.json"
HEARTBEAT_S = 10.0


class Stage:
    """A long start-up stage whose length only an earlier run knows (a model load, with a
    one-time conversion): while `around(work)` awaits it, a line every HEARTBEAT_S with the
    time so far and an ETA from the last run's duration (kept in `<data_dir>/stages.json`,
    per `key`), and `view` (for /status `extra.starting`) refreshed every second."""

    def __init__(self, label: str, key: str, data_dir: Path, view: dict,
                 clock: Callable[[], float] = time.monotonic, tick_s: float = 1.0,
                 say: Callable[[str], None] | None = None, heartbeat_s: float = HEARTBEAT_S):
        self.label, self.key, self.view, self.clock = label, key, view, clock
        self.path = Path(data_dir) / STAGES_FILE
        self.tick_s, self.heartbeat_s = tick_s, heartbeat_s
        self.say = say or (lambda line: log.info("%s", line))  # a CLI prints instead
        self.last = self._load().get(key)

    def _load(self) -> dict:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return {k: v for k, v in data.items() if isinstance(v, (int, float))} \
            if isinstance(data, dict) else {}

    def _save(self, seconds: float) -> None:
        data = self._load()
        data[self.key] = round(seconds, 1)
        try:  # best effort: a full disk or a read-only dir costs only the next ETA
            tmp = self.path.with_name(STAGES_FILE + ".tmp")
            tmp.write_text(json.dumps(data))
            os.replace(tmp, self.path)
        except OSError as e:
            log.debug("could not keep the duration of %s: %s", self.label, e)

    def eta_s(self, elapsed: float) -> float | None:
        return None if self.last is None else max(0.0, self.last - elapsed)

    def line(self, elapsed: float) -> str:
        eta = self.eta_s(elapsed)
        how = "first time: no ETA" if eta is None else (
            f"took {duration(self.last)} last time, ETA {duration(eta)}" if eta > 0
            else f"took {duration(self.last)} last time")
        return f"{self.label}: {duration(elapsed)} so far ({how})"

    async def around(self, work: Awaitable[T]) -> T:
        start = last_said = self.clock()
        task = asyncio.ensure_future(work)
        try:
            while True:
                elapsed = self.clock() - start
                eta = self.eta_s(elapsed)
                self.view.update({"doing": self.label, "elapsed_s": round(elapsed, 1),
                                  "eta_s": None if eta is None else round(eta, 1),
                                  "last_s": self.last})
                done, _ = await asyncio.wait({task}, timeout=self.tick_s)
                if done:
                    break
                if self.clock() - last_said >= self.heartbeat_s:
                    last_said = self.clock()
                    self.say(self.line(self.clock() - start))
            result = task.result()
        finally:
            if not task.done():
                task.cancel()
            self.view.clear()
        self._save(self.clock() - start)
        return result

    def run_blocking(self, fn: Callable[[], T]) -> T:
        """`around` for a synchronous caller (a CLI such as `doctor --load`): one line at
        once, one every `heartbeat_s`, and the duration kept for the next ETA. `fn` runs in
        a daemon thread, so Ctrl-C exits at once instead of waiting for the load to end."""
        box: dict[str, object] = {}

        def work() -> None:
            try:
                box["result"] = fn()
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
                box["error"] = e

        start = self.clock()
        self.say(self.line(0.0))
        thread = threading.Thread(target=work, name=self.key, daemon=True)
        thread.start()
        while True:
            thread.join(self.heartbeat_s)
            if not thread.is_alive():
                break
            self.say(self.line(self.clock() - start))
        if "error" in box:
            raise box["error"]  # type: ignore[misc]
        self._save(self.clock() - start)
        return box["result"]  # type: ignore[return-value]
