"""`swarm-node join` processes forked from a warm interpreter, for the integration tests.

A node process spends ~9 s of CPU before it is ready, nearly all of it importing torch,
transformers (the model's module) and py-libp2p; forked from a process that already imported
them it is ready after ~0.5 s (one trainer, measured 2026-12-03 on this 2-core machine). The
suite starts dozens of nodes on 2 cores, so this is minutes of its time.

Each node is still its own OS process running the real CLI entry point (`cli.main.main` with
its argv, environment, working directory and log file): only the imports are shared, through
multiprocessing's fork server (a clean single-threaded process, one per test worker, started on
first use). What a fresh interpreter must prove (start-up time, lazy imports, `--help`, the
installed console script) is tested with real `exec`s elsewhere (test_cli, test_demo,
test_fresh_clone). `SWARM_TEST_EXEC=1` makes every node a plain `exec` again.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
from pathlib import Path

# What the fork server imports once: the CLI and every role, torch, and the modeling modules of
# the model families the tests load (the tiny built-in model is Qwen2-shaped; SmolLM2 is Llama).
PRELOAD = [
    "swarm_node.cli.main",
    "swarm_node.node.runner",
    "swarm_node.node.roles.trainer",
    "swarm_node.node.roles.inference",
    "swarm_node.node.roles.relay",
    "torch",
    "transformers.models.qwen2.modeling_qwen2",
    "transformers.models.llama.modeling_llama",
]

_CONTEXT = None


def _context():
    global _CONTEXT
    if _CONTEXT is None:
        _CONTEXT = multiprocessing.get_context("forkserver")
        _CONTEXT.set_forkserver_preload(PRELOAD)
    return _CONTEXT


def _join(argv: list[str], env: dict[str, str], cwd: str, log: str) -> None:
    """The child: the environment, output and randomness a fresh process would have, then the
    CLI. Runs in a process forked from the fork server."""
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 (the process's own)
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stdin = open(os.devnull)  # noqa: SIM115
    sys.argv = ["swarm-node", *argv]
    import torch  # preloaded: free

    torch.seed()  # the fork server's generator state is shared by every child otherwise
    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "0")) or torch.get_num_threads())
    from swarm_node.cli.main import main

    main()


class Launched:
    """The part of `subprocess.Popen` the tests use, for a node forked from the fork server."""

    def __init__(self, process) -> None:
        self._process = process
        self.pid: int = process.pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and not self._process.is_alive():
            self.returncode = self._process.exitcode
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired(["swarm-node"], timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def start_join(bin_path: Path, argv: list[str], env: dict[str, str], log: Path):
    """`swarm-node <argv>` (argv starts with "join") with its output appended to `log`: forked
    from the fork server, or exec'd (`bin_path`) when SWARM_TEST_EXEC=1."""
    if os.environ.get("SWARM_TEST_EXEC") == "1":
        with open(log, "ab") as out:
            return subprocess.Popen([str(bin_path), *argv], stdout=out,
                                    stderr=subprocess.STDOUT, env=env)
    process = _context().Process(target=_join, args=(argv, dict(env), os.getcwd(), str(log)),
                                 daemon=True)
    process.start()
    return Launched(process)
