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

A node of the simulated internet (node/testing/netlab) is forked the same way and enters its
host's network namespace (`netns`) first, with setns(2) on /var/run/netns/<name>: the child is
a fresh single-threaded process, so every thread and socket it makes afterwards is in that
namespace (tests/netlab/test_launch.py checks its /proc/<pid>/ns/net, and that it dials out
from its host's LAN address through the home router's NAT). One fork server (root namespace)
serves every namespace. That is the part of `ip netns exec` a node needs; the rest it does
not: `ip netns exec` also gives the process a mount namespace with /sys remounted (so
/sys/class/net lists the namespace's devices) and /etc/netns/<name>/* bind-mounted over /etc,
and no node code reads /sys/class/net (addresses come from the routing table, `route_ip`, and
getaddrinfo) and the lab writes no /etc/netns/<name>. Such a node runs in its own session, as
`Lab.popen` starts its processes. `start_script` forks a test helper script (nat_peer.py)
the same way, with pipes to its stdin and stdout.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import runpy
import signal
import subprocess
import sys
from multiprocessing import reduction
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
NETNS_DIR = "/var/run/netns"  # where `ip netns` and pyroute2 keep a namespace's handle
CLONE_NEWNET = 0x40000000  # <sched.h>; os.setns and os.CLONE_NEWNET need Python 3.12


def _context():
    global _CONTEXT
    if _CONTEXT is None:
        _CONTEXT = multiprocessing.get_context("forkserver")
        _CONTEXT.set_forkserver_preload(PRELOAD)
    return _CONTEXT


def _enter_netns(name: str) -> None:
    """Move this (single-threaded) process into network namespace `name`."""
    fd = os.open(f"{NETNS_DIR}/{name}", os.O_RDONLY | os.O_CLOEXEC)
    try:
        if ctypes.CDLL(None, use_errno=True).setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into network namespace {name}: {os.strerror(err)}")
    finally:
        os.close(fd)


def _join(argv: list[str], env: dict[str, str], cwd: str, log: str,
          netns: str | None = None) -> None:
    """The child: the environment, output and randomness a fresh process would have (in
    `netns`, its own session, when given), then the CLI. Runs in a process forked from the
    fork server."""
    if netns is not None:
        _enter_netns(netns)
        os.setsid()
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


class _Fd:
    """A file descriptor handed to the child (through the fork server, as multiprocessing
    hands over sockets): the child's copy is `fd`."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self):
        return _Fd._rebuild, (reduction.DupFd(self.fd),)

    @staticmethod
    def _rebuild(dup) -> _Fd:
        return _Fd(dup.detach())


def _script(path: str, argv: list[str], env: dict[str, str], cwd: str, netns: str | None,
            stdin: _Fd, stdout: _Fd) -> None:
    """The child of `start_script`: `python <path> <argv>` with these standard streams."""
    if netns is not None:
        _enter_netns(netns)
        os.setsid()
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd, target in ((stdin.fd, 0), (stdout.fd, 1), (devnull, 2)):
        os.dup2(fd, target)
        os.close(fd)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115 (the process's own)
    sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115
    sys.argv = [path, *argv]
    runpy.run_path(path, run_name="__main__")


class Launched:
    """The part of `subprocess.Popen` the tests use, for a node forked from the fork server
    (`stdin`/`stdout`: text pipes to a `start_script` child)."""

    def __init__(self, process, stdin=None, stdout=None) -> None:
        self._process = process
        self.pid: int = process.pid
        self.returncode: int | None = None
        self.stdin = stdin
        self.stdout = stdout

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


def start_join(bin_path: Path, argv: list[str], env: dict[str, str], log: Path,
               netns: str | None = None):
    """`swarm-node <argv>` (argv starts with "join") with its output appended to `log`, in
    network namespace `netns` (a name under /var/run/netns) when given: forked from the fork
    server, or exec'd (`bin_path`, through `ip netns exec` for a namespace) when
    SWARM_TEST_EXEC=1."""
    if os.environ.get("SWARM_TEST_EXEC") == "1":
        prefix = ["ip", "netns", "exec", netns] if netns is not None else []
        with open(log, "ab") as out:
            return subprocess.Popen([*prefix, str(bin_path), *argv], stdout=out,
                                    stderr=subprocess.STDOUT, env=env,
                                    start_new_session=netns is not None)
    process = _context().Process(target=_join,
                                 args=(argv, dict(env), os.getcwd(), str(log), netns),
                                 daemon=True)
    process.start()
    return Launched(process)


def start_script(path: Path, argv: list[str], netns: str | None = None):
    """`python <path> <argv>` (a test helper that imports node modules, e.g. nat_peer.py)
    with text pipes to its stdin and from its stdout (`.stdin`, `.stdout`) and stderr
    discarded, in network namespace `netns` (own session) when given: forked from the fork
    server, or exec'd (through `ip netns exec` for a namespace) when SWARM_TEST_EXEC=1."""
    if os.environ.get("SWARM_TEST_EXEC") == "1":
        prefix = ["ip", "netns", "exec", netns] if netns is not None else []
        return subprocess.Popen([*prefix, sys.executable, str(path), *argv],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True,
                                start_new_session=netns is not None)
    in_r, in_w = os.pipe()
    out_r, out_w = os.pipe()
    try:
        process = _context().Process(
            target=_script, args=(str(path), list(argv), dict(os.environ), os.getcwd(), netns,
                                  _Fd(in_r), _Fd(out_w)), daemon=True)
        process.start()
    except BaseException:
        os.close(in_w)
        os.close(out_r)
        raise
    finally:
        os.close(in_r)
        os.close(out_w)
    return Launched(process, stdin=open(in_w, "w"), stdout=open(out_r))


BIN = Path(sys.executable).parent / "swarm-node"


def start_join_in(netns: str, argv: list[str], env: dict[str, str], log: Path):
    """`start_join` inside a lab host's network namespace: the netlab `LabSwarm` launcher."""
    return start_join(BIN, argv, env, log, netns=netns)
