"""Explicit lifecycles: background tasks with one owner, and changes waited on, not polled.

`TaskOwner`: every task a component runs in the background is started by its owner, which
keeps it referenced, retrieves its outcome when it ends (a failure is logged with its
traceback and counted, so "Task exception was never retrieved" cannot happen), and cancels
and awaits what is left at `close()`. asyncio.TaskGroup is the model; unlike a TaskGroup, a
failed task does not cancel its siblings: a node's background loops are independent (a
history write that fails must not stop a download).

`Changed`: a condition that code waits on with a deadline (`await changed.wait_for(pred,
timeout)`), woken by whoever changes what the condition reads (`changed.fire()`), instead of
looking again every so often.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable, Coroutine
from typing import Any

log = logging.getLogger(__name__)

CLOSE_TIMEOUT_S = 10.0


class TaskOwner:
    """The background tasks of one component (`name` appears in logs and counters)."""

    def __init__(self, name: str, on_failure: Callable[[str, BaseException], None] | None = None):
        self.name = name
        self.on_failure = on_failure
        self.failures: Counter[str] = Counter()  # by task name, for /metrics
        self._tasks: set[asyncio.Task] = set()

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str = "") -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro, name=f"{self.name}:{name or 'task'}")
        self._tasks.add(task)
        task.add_done_callback(self._finished)
        return task

    def _finished(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        error = task.exception()  # retrieved here, whoever else awaits the task
        if error is None:
            return
        name = task.get_name().partition(":")[2]
        self.failures[name] += 1
        log.error("background task %s of %s failed: %r", name, self.name, error,
                  exc_info=error)
        if self.on_failure is not None:
            self.on_failure(name, error)

    def __len__(self) -> int:
        return len(self._tasks)

    def __iter__(self):
        return iter(list(self._tasks))

    async def close(self, timeout: float = CLOSE_TIMEOUT_S, cancel: bool = True) -> None:
        """Cancel the tasks (or with `cancel=False` let them finish, e.g. closes of
        streams) and wait up to `timeout` for them; what is still running then is cancelled
        and named in the log."""
        tasks = list(self._tasks)
        if not tasks:
            return
        if cancel:
            for task in tasks:
                task.cancel()
        _, stuck = await asyncio.wait(tasks, timeout=timeout)
        if stuck:
            log.warning("%s: %d background tasks did not stop within %.0fs: %s", self.name,
                        len(stuck), timeout, ", ".join(sorted(t.get_name() for t in stuck)))
            for task in stuck:
                task.cancel()


async def wait_set(event: asyncio.Event, timeout: float) -> bool:
    """Wait up to `timeout` seconds for `event`; True if it was set. For the background
    loops that sleep until woken: `asyncio.wait_for(event.wait(), t)` on Python 3.11
    returns instead of raising when a cancel arrives as the event is set (gh-86296), so
    the loop ran one more round and slept again, and the close of its owner waited out
    CLOSE_TIMEOUT_S (the dht and relay loops, woken by the reachability change of a node
    that closes soon after start: 10 s, one close in two). `asyncio.timeout` never
    swallows a cancel."""
    try:
        async with asyncio.timeout(timeout):
            await event.wait()
    except TimeoutError:
        return event.is_set()
    return True


class Changed:
    """Wakes everyone waiting for a condition when something it reads changed. `fire()` is
    called in the event loop's thread (e.g. from a callback)."""

    def __init__(self) -> None:
        self._waiters: set[asyncio.Future] = set()

    def fire(self) -> None:
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)
        self._waiters.clear()

    async def wait_for(self, predicate: Callable[[], bool], timeout: float | None = None) -> bool:
        """Until `predicate()` holds (True) or `timeout` seconds passed (False); it is
        checked at once and after each `fire()`."""
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(timeout):
                while not predicate():
                    waiter = loop.create_future()
                    self._waiters.add(waiter)
                    try:
                        await waiter
                    finally:
                        self._waiters.discard(waiter)
        except TimeoutError:
            return predicate()
        return True
