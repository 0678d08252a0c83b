"""More processes forked warm from tests/launch.py's fork server: demo nodes (the demo's
`start_node`, forked) and test programs run as `python -m MODULE` / `python FILE` with pipes
(the broadcast peers, the p2p peer and crash processes).

A broadcast or p2p peer process spends ~2 s of CPU importing py-libp2p and the node before it
runs (a `swarm-node join` ~9 s); forked from the warm server it starts in a fraction of that.
Each is still its own OS process running the program's real `__main__` with its argv,
environment, working directory and standard streams; only the imports are shared.
`SWARM_TEST_EXEC=1` makes every one a plain `exec` again, as for tests/launch.py.
"""

from __future__ import annotations

import fcntl
import os
import runpy
import socket
import subprocess
import sys
from multiprocessing import reduction
from pathlib import Path

from swarm_node.node.config import dump_toml

from tests.launch import PRELOAD, Launched, start_join

BIN = Path(sys.executable).parent / "swarm-node"
PIPE, STDOUT = subprocess.PIPE, subprocess.STDOUT


def start_demo_node(node, cfg: dict) -> None:
    """`swarm_node.node.demo.start_node`, the node forked warm (`start_join`): the same
    config file, start-notice socket, environment and log (`demo.wait_info`,
    `demo.stop_nodes` and `demo.fetch_status` work on it unchanged)."""
    node.dir.mkdir(parents=True, exist_ok=True)
    path = node.dir / "node.toml"
    path.write_text(dump_toml(cfg))
    if node.notices is not None:  # a restarted node: a fresh socket
        node.notices.close()
    node.notices = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    name = f"swarm-demo-{os.getpid()}-{id(node):x}-{node.name}"
    node.notices.bind("\0" + name)
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", NOTIFY_SOCKET="@" + name)
    node.log_path.touch()  # as the demo's: there before the node (the child opens it later)
    node.proc = start_join(BIN, ["join", "--config", str(path)], env, node.log_path)


class _Fd:
    """A descriptor handed to the forked child (duplicated through the fork server's socket,
    as multiprocessing hands over a Connection)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self):
        return _detach, (reduction.DupFd(self.fd),)


def _detach(dup) -> int:
    return dup.detach()


def _run(program: tuple[str, str], argv: list[str], env: dict[str, str], cwd: str,
         stdio: tuple) -> None:
    """The child: a fresh process's environment, streams and randomness, then the program's
    `__main__` (`program`: ("module", name) or ("path", file))."""
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 3) for fd in stdio]  # none is 0-2 while we dup2
    for fd in stdio:
        os.close(fd)
    for target, fd in enumerate(high):
        os.dup2(fd, target)
        os.close(fd)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115 (the process's own)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    if "torch" in sys.modules:  # preloaded: the fork server's generator is every child's
        sys.modules["torch"].seed()
    kind, name = program
    sys.argv = [name, *argv]
    if kind == "module":
        runpy.run_module(name, run_name="__main__", alter_sys=True)
    else:
        sys.path.insert(0, str(Path(name).parent))
        runpy.run_path(name, run_name="__main__")


class Forked(Launched):
    """`subprocess.Popen`'s surface for a forked program: pid, poll, wait, send_signal,
    terminate, kill, and text `stdin` / `stdout` where PIPE was asked for."""

    def __init__(self, process, stdin, stdout) -> None:
        super().__init__(process)
        self.stdin, self.stdout = stdin, stdout


def start_program(*, module: str | None = None, path: Path | None = None,
                  argv: list[str], env: dict[str, str], stdin=None, stdout=None, stderr=None):
    """`python -m module argv` (or `python path argv`) forked warm. stdin: PIPE for a text
    pipe (`.stdin`), else /dev/null; stdout: PIPE (`.stdout`), a file path (appended to) or
    an open descriptor, else /dev/null; stderr: the same, or STDOUT."""
    if (module is None) == (path is None):
        raise ValueError("one of module, path")
    if os.environ.get("SWARM_TEST_EXEC") == "1":
        return _exec(module, path, argv, env, stdin, stdout, stderr)
    ours: list = []
    theirs: list[int] = []
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
        program = ("module", module) if module else ("path", str(path))
        process = _context().Process(target=_run, daemon=True, args=(
            program, list(argv), dict(env), os.getcwd(), tuple(_Fd(fd) for fd in theirs)))
        process.start()
    except BaseException:
        for f in ours:
            f.close()
        raise
    finally:
        for fd in theirs:  # the child holds its own copies now
            os.close(fd)
    return Forked(process, ours[0] if stdin == PIPE else None,
                  ours[-1] if stdout == PIPE else None)


def _output(where) -> int:
    """A descriptor of our own for an output stream: a file path (appended), a descriptor
    (duplicated) or /dev/null."""
    if isinstance(where, Path):
        return os.open(where, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    if isinstance(where, int) and where >= 0:
        return os.dup(where)
    return os.open(os.devnull, os.O_WRONLY)


def _exec(module, path, argv, env, stdin, stdout, stderr) -> subprocess.Popen:
    """The same program exec'd (SWARM_TEST_EXEC=1)."""
    cmd = [sys.executable, *(["-m", module] if module else [str(path)]), *argv]
    opened = []

    def stream(where):
        if isinstance(where, Path):
            opened.append(open(where, "ab"))  # noqa: SIM115 (closed below: the child has it)
            return opened[-1]
        return subprocess.DEVNULL if where is None else where

    try:
        return subprocess.Popen(cmd, stdin=stdin or subprocess.DEVNULL, stdout=stream(stdout),
                                stderr=stream(stderr), text=True, env=env)
    finally:
        for f in opened:
            f.close()


def _context():
    """tests/launch.py's fork server (one per process: multiprocessing keeps one), with its
    preload, whichever of the two starts it first."""
    import multiprocessing

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    return context
