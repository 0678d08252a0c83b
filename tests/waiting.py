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
import os
import select
import socket
import subprocess
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


class StartNotices:
    """The start notices of one `swarm-node join` process (runner.notify_supervisor, the
    sd_notify protocol), on an abstract unix datagram socket of the test's own: start the
    process with `env()`, then `wait()` returns once it said READY=1 (joined, its role
    running) and fails at once if it exits first. An event, not a look at its log."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        name = f"swarm-test-{os.getpid()}-{id(self):x}"
        self.sock.bind("\0" + name)
        self.address = "@" + name
        self.said: list[str] = []

    def env(self, base: dict | None = None) -> dict:
        return {**(os.environ if base is None else base), "NOTIFY_SOCKET": self.address}

    def wait(self, proc: subprocess.Popen, timeout: float, want: str = "READY=1", *,
             details: Callable[[], str] = str) -> str:
        """The first notice containing `want` (blocking: from an event loop, run it in a
        thread)."""
        exited = os.pidfd_open(proc.pid)  # readable once the process ends
        deadline = time.monotonic() + timeout
        try:
            while (left := deadline - time.monotonic()) > 0:
                ready, _, _ = select.select([self.sock, exited], [], [], left)
                if self.sock in ready:
                    notice = self.sock.recv(4096).decode(errors="replace")
                    self.said.append(notice)
                    if want in notice:
                        return notice
                elif ready:
                    pytest.fail(f"the node exited with {proc.wait()} before it said {want} "
                                f"(it said {self.said})\n{details()}")
        finally:
            os.close(exited)
        pytest.fail(f"timed out after {timeout:.0f} s waiting for the node to say {want} "
                    f"(it said {self.said})\n{details()}")

    def close(self) -> None:
        self.sock.close()
