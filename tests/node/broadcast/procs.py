"""Broadcast peers as real subprocesses (node/testing/broadcast_peer.py), for fault tests and
the benchmark. Each process is stopped through its own handle. The tests' peers (`fork=True`)
are forked warm (tests/launch.py: ~2 s of CPU importing py-libp2p saved per peer); the
benchmark's are exec'd."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from tests.launch import PIPE, start_program


class BroadcastProc:
    def __init__(self, name: str, role: str, data_dir: Path, *args: str, key: Path | None = None,
                 log_level: str = "WARNING", fork: bool = False):
        self.name = name
        module = "swarm_node.node.testing.broadcast_peer"
        argv = ["--role", role, "--data-dir", str(data_dir), "--log-level", log_level, *args]
        if key is not None:
            argv += ["--key", str(key)]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        # not beside data_dir: a test may put that on a tiny filesystem and fill it, and the
        # "disk full" line the test looks for would then be lost (ENOSPC) with everything else
        self.stderr_path = Path(tempfile.mkdtemp(prefix="bcast-")) / f"{name}.stderr"
        Path(data_dir).parent.mkdir(parents=True, exist_ok=True)
        self._stderr = open(self.stderr_path, "w")  # noqa: SIM115 - closed in stop()
        if fork:
            self.proc = start_program(module=module, argv=argv, env=env, stdin=PIPE,
                                      stdout=PIPE, stderr=self._stderr.fileno())
        else:
            self.proc = subprocess.Popen([sys.executable, "-m", module, *argv],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=self._stderr, text=True, env=env)
        # read by a thread (the pipe is blocking), handed to the test's event loop
        self._loop = asyncio.get_running_loop()
        self.events: asyncio.Queue[dict] = asyncio.Queue()
        self.seen: list[dict] = []
        threading.Thread(target=self._read, daemon=True).start()
        self.info: dict = {}

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                self._put(json.loads(line))
            except json.JSONDecodeError:
                continue
        self._put({"event": "eof"})

    def _put(self, ev: dict) -> None:
        try:
            self._loop.call_soon_threadsafe(self.events.put_nowait, ev)
        except RuntimeError:  # the test's loop is closed: nobody waits any more
            pass

    async def event(self, kind: str, timeout: float = 60, **match) -> dict:
        """The next event of `kind` whose fields equal `match` (earlier events of other
        kinds are kept in `seen`)."""
        try:
            async with asyncio.timeout(timeout):
                while True:
                    ev = await self.events.get()
                    self.seen.append(ev)
                    if ev["event"] == kind and all(ev.get(k) == v for k, v in match.items()):
                        return ev
                    if ev["event"] == "eof":
                        raise RuntimeError(f"{self.name} exited; stderr: "
                                           f"{self.stderr_tail()}")
        except TimeoutError:
            raise TimeoutError(f"{self.name}: no {kind!r} event {match or ''} in {timeout}s; "
                               f"stderr: {self.stderr_tail()}") from None

    async def ready(self, timeout: float = 60) -> dict:
        self.info = await self.event("ready", timeout)
        return self.info

    @property
    def peer_id(self) -> str:
        return self.info["peer_id"]

    @property
    def addrs(self) -> list[str]:
        return self.info["addrs"]

    def send(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def kill(self) -> None:
        """SIGKILL: the process gets no chance to clean up (a crash)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self, timeout: float = 15) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
                self.proc.stdin.close()
                self.proc.wait(timeout)
            except (OSError, subprocess.TimeoutExpired):
                self.kill()
        self._stderr.close()

    def stderr_tail(self, n: int = 2000) -> str:
        try:
            return self.stderr_path.read_text()[-n:]
        except OSError:
            return ""
