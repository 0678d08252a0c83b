"""Waiting on a condition with a deadline, for tests.

Prefer a real event: a line a process prints, an asyncio.Event, a future, a queue. These
helpers poll a predicate and are for conditions that nothing signals (another process's
/status, a counter without a hook). They never pass on time alone: they return as soon as
the condition holds and fail, naming what they waited for, when the deadline passes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest


def wait_until(pred: Callable[[], object], timeout: float, what: str, *,
               interval: float = 0.1, details: Callable[[], str] = str) -> None:
    """Poll `pred` every `interval` s until it is true; fail after `timeout` s.
    `details()` is appended to the failure (a log tail, the last status)."""
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}\n{details()}")
        time.sleep(interval)


async def async_wait_until(pred: Callable[[], object], timeout: float, what: str, *,
                           interval: float = 0.02, details: Callable[[], str] = str) -> None:
    """`wait_until` on an event loop (the loop keeps running between polls)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not pred():
        if loop.time() > deadline:
            pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}\n{details()}")
        await asyncio.sleep(interval)
