"""Waiting on a condition with a deadline, for tests.

Prefer a real event: a line a process prints, an asyncio.Event, a future, a queue, a
`Changed` (node/lifecycle.py). These helpers poll a predicate and are for conditions that
nothing signals (another process's /status, a counter without a hook, py-libp2p's state in
its own thread). They never pass on time alone: they return the predicate's (true) value as
soon as it holds and fail, naming what they waited for, when the deadline passes.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable
from typing import Any

import pytest
import trio


def wait_until(pred: Callable[[], Any], timeout: float, what: str, *,
               interval: float = 0.1, details: Callable[[], str] = str) -> Any:
    """Poll `pred` every `interval` s until it is true; fail after `timeout` s.
    `details()` is appended to the failure (a log tail, the last status)."""
    deadline = time.monotonic() + timeout
    while not (got := pred()):
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}\n{details()}")
        time.sleep(interval)
    return got


async def async_wait_until(pred: Callable[[], Any], timeout: float, what: str, *,
                           interval: float = 0.02, details: Callable[[], str] = str) -> Any:
    """`wait_until` on an event loop (the loop keeps running between polls). `pred` may
    be a coroutine function (e.g. a request to another process)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        got = pred()
        if inspect.iscoroutine(got):
            got = await got
        if got:
            return got
        if loop.time() > deadline:
            pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}\n{details()}")
        await asyncio.sleep(interval)


async def trio_wait_until(pred: Callable[[], Any], timeout: float, what: str, *,
                          interval: float = 0.01) -> Any:
    """`async_wait_until` for tests that run in trio (py-libp2p on its own)."""
    deadline = trio.current_time() + timeout
    while not (got := pred()):
        if trio.current_time() > deadline:
            pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")
        await trio.sleep(interval)
    return got
