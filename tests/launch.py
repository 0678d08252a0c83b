"""Test processes forked from a warm interpreter: `swarm-node join` nodes (alone, in a netlab
host's network namespace, or as the demo starts them) and test programs (`python -m MODULE` /
`python FILE`) with pipes.

A node process spends ~9 s of CPU before it is ready, nearly all of it importing torch,
transformers (the model's module) and py-libp2p; forked from a process that already imported
them it is ready after ~0.5 s (one trainer, measured 2026-12-03 on this 2-core machine). A
broadcast or p2p peer program spends ~2 s importing py-libp2p and the node. The suite starts
dozens of them on 2 cores, so this is minutes of its time.

Each is still its own OS process running the real entry point (`cli.main.main`, or the
program's `__main__`) with its own argv, environment, working directory, standard streams and
log: only the imports are shared, through multiprocessing's fork server (a clean
single-threaded process, one per test worker, started on first use). Like `subprocess.Popen`,
a start returns once the child runs our code with its signal handlers restored (the fork server
ignores SIGINT, and its child restores the handlers just after the fork: a Ctrl-C sent before
that would be lost). What a fresh interpreter must prove (start-up time, lazy imports,
`--help`, the installed console script, the demo) is tested with real `exec`s elsewhere
(test_cli, test_demo, test_fresh_clone). `SWARM_TEST_EXEC=1` makes every start a plain `exec`
again.

A node of the simulated internet (node/testing/netlab) is forked the same way and enters its
host's network namespace (`netns`) first, with setns(2) on /var/run/netns/<name>: the child is
a fresh single-threaded process, so every thread and socket it makes afterwards is in that
namespace (tests/netlab/test_launch.py checks its /proc/<pid>/ns/net, its sockets and what it
can reach). One fork server (root namespace) serves every namespace. That is the part of
`ip netns exec` a node needs; the rest it does not: `ip netns exec` also gives the process a
mount namespace with /sys remounted (so /sys/class/net lists the namespace's devices) and
/etc/netns/<name>/* bind-mounted over /etc, and no node code reads /sys/class/net (addresses
come from the routing table, `route_ip`, and getaddrinfo) and the lab writes no
/etc/netns/<name>. Such a process runs in its own session, as `Lab.popen` starts its processes.
"""

from __future__ import annotations

import ctypes
import fcntl
import multiprocessing
import os
import runpy
import signal
import subprocess
import sys
from multiprocessing import reduction
from pathlib import Path

from swarm_node.node.demo import prepare_node

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

BIN = Path(sys.executable).parent / "swarm-node"
PIPE, STDOUT = subprocess.PIPE, subprocess.STDOUT
NETNS_DIR = "/var/run/netns"  # where `ip netns` and pyroute2 keep a namespace's handle
CLONE_NEWNET = 0x40000000  # <sched.h>; os.setns and os.CLONE_NEWNET need Python 3.12

_CONTEXT = None


def _context():
    global _CONTEXT
    if _CONTEXT is None:
        _CONTEXT = multiprocessing.get_context("forkserver")
        _CONTEXT.set_forkserver_preload(PRELOAD)
    return _CONTEXT


class _Fd:
    """A descriptor handed to the child (through the fork server's socket, as multiprocessing
    hands over a Connection): the child's copy is `fd`."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self):
        return _Fd._rebuild, (reduction.DupFd(self.fd),)

    @staticmethod
    def _rebuild(dup) -> _Fd:
        return _Fd(dup.detach())


def _enter_netns(name: str) -> None:
    """Move this (single-threaded) process into network namespace `name`."""
    fd = os.open(f"{NETNS_DIR}/{name}", os.O_RDONLY | os.O_CLOEXEC)
    try:
        if ctypes.CDLL(None, use_errno=True).setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into network namespace {name}: {os.strerror(err)}")
    finally:
        os.close(fd)


def _become(started: _Fd, env: dict[str, str], cwd: str, netns: str | None,
            stdio: tuple[_Fd, _Fd, _Fd]) -> None:
    """The child's first steps: enter `netns` in its own session when given (its own session
    alone when `netns` is "": `start_new_session`), tell the parent it runs (its signal
    handlers are restored by now), then a fresh process's environment, working directory,
    standard streams, and torch's seed and threads (OMP_NUM_THREADS, which torch read at its
    import: the fork server's)."""
    if netns:
        _enter_netns(netns)
    if netns is not None:
        os.setsid()
    os.close(started.fd)  # after setsid: os.killpg(pid) reaches it once the start returned
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    high = [fcntl.fcntl(f.fd, fcntl.F_DUPFD, 3) for f in stdio]  # none is 0-2 while we dup2
    for f in stdio:
        os.close(f.fd)
    for target, fd in enumerate(high):
        os.dup2(fd, target)
        os.close(fd)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115 (the process's own)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    if "torch" in sys.modules:  # preloaded: the fork server's generator is every child's
        torch = sys.modules["torch"]
        torch.seed()
        torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "0")) or torch.get_num_threads())


def _join(argv: list[str], env: dict[str, str], started: _Fd, cwd: str, netns: str | None,
          stdio: tuple[_Fd, _Fd, _Fd]) -> None:
    """The child of `start_join`: `swarm-node <argv>`."""
    _become(started, env, cwd, netns, stdio)
    sys.argv = ["swarm-node", *argv]
    from swarm_node.cli.main import main

    main()


def _run(program: tuple[str, str], argv: list[str], env: dict[str, str], started: _Fd,
         cwd: str, netns: str | None, stdio: tuple[_Fd, _Fd, _Fd]) -> None:
    """The child of `start_program`: the program's `__main__` (`program`: ("module", name)
    or ("path", file))."""
    _become(started, env, cwd, netns, stdio)
    kind, name = program
    sys.argv = [name, *argv]
    if kind == "module":
        runpy.run_module(name, run_name="__main__", alter_sys=True)
    else:
        sys.path.insert(0, str(Path(name).parent))
        runpy.run_path(name, run_name="__main__")


class Launched:
    """The part of `subprocess.Popen` the tests use, for a forked process: pid, poll, wait,
    send_signal, terminate, kill, and text `stdin` / `stdout` where PIPE was asked for."""

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


def _output(where) -> int:
    """A descriptor of our own for an output stream: a file path (appended), a descriptor
    (duplicated) or /dev/null."""
    if isinstance(where, Path):
        return os.open(where, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    if isinstance(where, int) and where >= 0:
        return os.dup(where)
    return os.open(os.devnull, os.O_WRONLY)


def _fork(target, head: tuple, env: dict[str, str], netns: str | None, stdin, stdout,
          stderr) -> Launched:
    """Fork `target(*head, env, started, cwd, netns, stdio)` from the fork server with these
    streams (as `start_program` takes them); return once the child runs."""
    ours: list = []
    theirs: list[int] = []
    ready_r, ready_w = os.pipe()
    try:
        if stdin == PIPE:
            r, w = os.pipe()
            theirs.append(r)
            ours.append(open(w, "w", buffering=1))  # noqa: SIM115 (closed by the caller)
        else:
            theirs.append(os.open(os.devnull, os.O_RDONLY))
        if stdout == PIPE:
            r, w = os.pipe()
            theirs.append(w)
            ours.append(open(r))  # noqa: SIM115 (closed by the caller)
        else:
            theirs.append(_output(stdout))
        theirs.append(os.dup(theirs[1]) if stderr == STDOUT else _output(stderr))
        process = _context().Process(target=target, daemon=True, args=(
            *head, dict(env), _Fd(ready_w), os.getcwd(), netns,
            tuple(_Fd(fd) for fd in theirs)))
        process.start()
    except BaseException:
        for f in ours:
            f.close()
        os.close(ready_r)
        raise
    finally:
        os.close(ready_w)
        for fd in theirs:  # the child holds its own copies now
            os.close(fd)
    try:
        os.read(ready_r, 1)  # EOF: the child closed its end (or died before)
    finally:
        os.close(ready_r)
    return Launched(process, ours[0] if stdin == PIPE else None,
                    ours[-1] if stdout == PIPE else None)


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
    return _fork(_join, (list(argv),), env, netns, None, Path(log), STDOUT)


def start_join_in(netns: str, argv: list[str], env: dict[str, str], log: Path):
    """`start_join` inside a lab host's network namespace: the netlab `LabSwarm` launcher."""
    return start_join(BIN, argv, env, log, netns=netns)


def start_demo_node(node, cfg: dict) -> None:
    """`swarm_node.node.demo.start_node`, the node forked warm (`start_join`): the same
    config file, start-notice socket, environment and log (`demo.prepare_node`), so
    `demo.wait_info`, `demo.stop_nodes` and `demo.fetch_status` work on it unchanged."""
    path, env = prepare_node(node, cfg)
    node.proc = start_join(BIN, ["join", "--config", str(path)], env, node.log_path)


def start_program(*, module: str | None = None, path: Path | None = None,
                  argv: list[str], env: dict[str, str] | None = None, stdin=None, stdout=None,
                  stderr=None, netns: str | None = None, new_session: bool = False):
    """`python -m module argv` (or `python path argv`) forked warm, in network namespace
    `netns` (own session) when given, in a session of its own when `new_session` (as
    Popen's `start_new_session`: `os.killpg(proc.pid, ...)` reaches its children). env: the
    environment (default: ours); stdin: PIPE for a text pipe (`.stdin`), else /dev/null;
    stdout: PIPE (`.stdout`), a file path (appended to) or an open descriptor, else
    /dev/null; stderr: the same, or STDOUT."""
    if (module is None) == (path is None):
        raise ValueError("one of module, path")
    env = dict(os.environ) if env is None else env
    if os.environ.get("SWARM_TEST_EXEC") == "1":
        return _exec(module, path, argv, env, stdin, stdout, stderr, netns, new_session)
    program = ("module", module) if module else ("path", str(path))
    session = netns if netns is not None else ("" if new_session else None)
    return _fork(_run, (program, list(argv)), env, session, stdin, stdout, stderr)


def _exec(module, path, argv, env, stdin, stdout, stderr, netns,
          new_session) -> subprocess.Popen:
    """The same program exec'd (SWARM_TEST_EXEC=1)."""
    prefix = ["ip", "netns", "exec", netns] if netns is not None else []
    cmd = [*prefix, sys.executable, *(["-m", module] if module else [str(path)]), *argv]
    opened = []

    def stream(where):
        if isinstance(where, Path):
            opened.append(open(where, "ab"))  # noqa: SIM115 (closed below: the child has it)
            return opened[-1]
        return subprocess.DEVNULL if where is None else where

    try:
        return subprocess.Popen(cmd, stdin=stdin or subprocess.DEVNULL, stdout=stream(stdout),
                                stderr=stream(stderr), text=True, env=env,
                                start_new_session=netns is not None or new_session)
    finally:
        for f in opened:
            f.close()
