"""Real `swarm-node join` processes inside lab hosts: the scenario harness of the tests and
of benchmarks/wan.py.

Each node runs on one lab host with its own folder (node.toml, node.log, data/), listens on
its host's lab address (port 4001, so the bulk plane takes 4002 as on a real machine),
and is driven only the way an operator drives it: its config file, `swarm-node join`, its
node.json and its admin endpoint. The admin endpoint listens on 127.0.0.1 of the node's own
namespace, so `status()` reads it from a thread inside that namespace.

Settings are config sections (dicts) merged over `BASE_SETTINGS`: the tiny model on the toy
task, small and fast like the demo's swarm. The harness imports no node code; it writes the
TOML itself (`to_toml`).

How a node process is started is the caller's (`launch`): by default `Lab.popen` execs
`python -m swarm_node.cli.main join ...` through `ip netns exec` (benchmarks/wan.py); the tests
pass a launcher that forks a warm interpreter into the host's namespace (tests/launch.py).
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

from . import nsutil
from .errors import NetlabError
from .lab import Lab

P2P_PORT = 4001
START_TIMEOUT_S = 180.0
POLL_THREADS = 8

# The demo's small swarm (node/demo.py): toy task, two new tokens, a trainer that waits for
# one verified peer batch per step. Sections here are merged with the caller's, key by key.
BASE_SETTINGS: dict[str, dict] = {
    "admin": {"port": 0},
    "p2p": {"bootstrap_timeout_s": 120.0},
    "broadcast": {"shard_size": 64 * 1024},
    "tasks": {"mix": {"toy/digit_successor": 1.0}, "tasks_per_round": 8},
    "sampler": {"completions_per_task": 8, "max_new_tokens": 2, "temperature": 1.0},
    "trainer": {"learning_rate": 3e-3, "local_items": 16, "external_items": 0,
                "peer_batches_per_step": 1, "peer_wait_s": 20.0},
}


# Starts `swarm-node <argv>` (argv begins with "join") in network namespace `netns` with
# environment `env`, output appended to `log`; returns its process (what `subprocess.Popen`
# offers: pid, poll, wait, send_signal, kill, returncode).
Launcher = Callable[[str, list[str], dict, Path], subprocess.Popen]


@dataclass
class LabNode:
    """One `swarm-node join` process on one lab host."""

    name: str
    host: str
    role: str
    dir: Path
    settings: dict = field(default_factory=dict)
    proc: subprocess.Popen | None = None
    info: dict = field(default_factory=dict)  # node.json: peer_id, listen_addrs, admin_port
    status: dict = field(default_factory=dict)  # the last /status read
    exit_code: int | None = None

    @property
    def log_path(self) -> Path:
        return self.dir / "node.log"

    @property
    def peer_id(self) -> str:
        return self.info.get("peer_id", "")

    @property
    def addr(self) -> str:
        """The multiaddr others bootstrap from (its first listen address)."""
        return self.info["listen_addrs"][0]

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


class LabSwarm:
    """The nodes of one scenario. Stop them with `stop_all` (a `with` block does it)."""

    def __init__(self, lab: Lab, workdir: Path, model_dir: Path, swarm_id: str = "wan",
                 settings: dict | None = None, launch: Launcher | None = None):
        self.lab = lab
        self.launch = launch
        self.workdir = Path(workdir)
        self.model_dir = Path(model_dir)
        self.swarm_id = swarm_id
        self.settings = merge(BASE_SETTINGS, settings or {})
        self.nodes: dict[str, LabNode] = {}

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.stop_all()

    # --- starting --------------------------------------------------------------------------

    def config(self, node: LabNode, bootstrap: list[str], follow: list[str]) -> dict:
        return merge(self.settings, {
            "node": {"role": node.role, "swarm_id": self.swarm_id,
                     "data_dir": str(node.dir / "data"),
                     "listen": [f"/ip4/{self.lab.addr(node.host)}/tcp/{P2P_PORT}"],
                     "bootstrap": bootstrap, "follow": follow},
            "model": {"name": str(self.model_dir)},
        }, node.settings)

    def start(self, name: str, host: str, role: str, bootstrap: list[LabNode] = (),
              follow: list[LabNode] = (), settings: dict | None = None) -> LabNode:
        """Write the node's config and start `swarm-node join` on `host` (returns at once;
        `wait_started` waits for its node.json)."""
        if name in self.nodes and self.nodes[name].proc and self.nodes[name].proc.poll() is None:
            raise NetlabError(f"lab node {name} is already running")
        node = LabNode(name, host, role, self.workdir / name, settings or {})
        node.dir.mkdir(parents=True, exist_ok=True)
        (node.dir / "data" / "node.json").unlink(missing_ok=True)
        path = node.dir / "node.toml"
        path.write_text(to_toml(self.config(node, [b.addr for b in bootstrap],
                                            [f.peer_id for f in follow])))
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        argv = ["join", "--config", str(path)]
        if self.launch is not None:
            node.proc = self.launch(self.lab.ns(host), argv, env, node.log_path)
        else:
            with open(node.log_path, "ab") as log:
                node.proc = self.lab.popen(
                    host, [sys.executable, "-m", "swarm_node.cli.main", *argv], env=env,
                    stdout=log, stderr=subprocess.STDOUT)
        self.nodes[name] = node
        return node

    def wait_started(self, *nodes: LabNode, timeout: float = START_TIMEOUT_S) -> None:
        """Wait until each node wrote node.json (listening, admin endpoint up)."""
        deadline = time.monotonic() + timeout
        for node in nodes:
            path = node.dir / "data" / "node.json"
            while True:
                self._check_alive(node)
                try:
                    node.info = json.loads(path.read_text())
                    break
                except (OSError, ValueError):
                    pass
                if time.monotonic() > deadline:
                    raise NetlabError(f"lab node {node.name} did not start within "
                                      f"{timeout:.0f}s; its log:\n{node.tail()}")
                time.sleep(0.2)

    # --- watching ----------------------------------------------------------------------------

    def read_status(self, node: LabNode, timeout: float = 5.0) -> dict:
        """GET /status from inside the node's namespace (its admin endpoint is loopback)."""
        port = node.info.get("admin_port")
        if not port or node.proc is None or node.proc.poll() is not None:
            return node.status

        def get():
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/status",
                                        timeout=timeout) as r:
                return json.loads(r.read())

        try:
            node.status = nsutil.in_netns(self.lab.ns(node.host), get)
        except (urllib.error.URLError, OSError, ValueError):
            pass  # busy or restarting: keep the last status
        return node.status

    def poll(self, *nodes: LabNode) -> None:
        """Refresh the status of these nodes (default: all running), a few at a time; a node
        that exited unexpectedly raises with its log."""
        nodes = nodes or tuple(self.running())
        for node in nodes:
            self._check_alive(node)
        with ThreadPoolExecutor(max_workers=POLL_THREADS) as pool:
            list(pool.map(self.read_status, nodes))

    def running(self) -> list[LabNode]:
        return [n for n in self.nodes.values() if n.proc is not None and n.exit_code is None]

    def wait_until(self, pred, timeout: float, what: str, every: float = 1.0) -> float:
        """Poll every running node each `every` s until `pred()` is true; returns the time it
        took. On timeout, raises with the tail of every log."""
        t0 = time.monotonic()
        while True:
            self.poll()
            if pred():
                return time.monotonic() - t0
            if time.monotonic() - t0 > timeout:
                logs = "\n".join(f"--- {n.name}\n{n.tail(25)}" for n in self.nodes.values())
                raise NetlabError(f"timed out after {timeout:.0f}s waiting for: {what}\n{logs}")
            time.sleep(every)

    def _check_alive(self, node: LabNode) -> None:
        if node.proc is not None and node.exit_code is None and node.proc.poll() is not None:
            node.exit_code = node.proc.returncode
            raise NetlabError(f"lab node {node.name} exited with {node.exit_code}; its log:\n"
                              f"{node.tail()}")

    # --- stopping ------------------------------------------------------------------------

    def stop(self, node: LabNode, kill: bool = False, grace: float = 60.0) -> int | None:
        """SIGTERM (a clean leave) or SIGKILL (a crash, a pulled cable) one node."""
        if node.proc is None or node.exit_code is not None:
            return node.exit_code
        if node.proc.poll() is None:
            node.proc.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
            try:
                node.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                node.proc.kill()
                node.proc.wait()
        node.exit_code = node.proc.returncode
        return node.exit_code

    def stop_all(self, grace: float = 60.0) -> dict[str, int | None]:
        """SIGTERM every running node at once, SIGKILL what is left after `grace`."""
        running = self.running()
        for node in running:
            if node.proc.poll() is None:
                node.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for node in running:
            try:
                node.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                node.proc.kill()
                node.proc.wait()
            node.exit_code = node.proc.returncode
        return {n.name: n.exit_code for n in self.nodes.values()}


def accepted_from(trainer: LabNode, node: LabNode) -> int:
    """Rollouts of `node` the trainer accepted (its /status, by peer id)."""
    return trainer.status.get("accepted_by_peer", {}).get(node.peer_id, {}).get("accepted", 0)


# Log lines that show a peer could not be reached (today's behaviour behind NAT), counted per
# node by `log_signals`: what the scenario observed, not an assertion.
LOG_SIGNALS = {
    # a peer's bulk plane (shards, gossip bodies) could not be used: libp2p streams instead
    "payload_plane_unusable": "over libp2p streams (bulk plane",
    "request_timed_out": "timed out after",
    "unretrieved_task_error": "Task exception was never retrieved",
    "errors": " ERROR ",
}


def log_signals(node: LabNode) -> dict[str, int]:
    try:
        text = node.log_path.read_text(errors="replace")
    except OSError:
        return {}
    return {key: text.count(needle) for key, needle in LOG_SIGNALS.items()}


def merge(*sections: dict) -> dict:
    """Config sections merged left to right, key by key inside each section."""
    out: dict[str, dict] = {}
    for cfg in sections:
        for section, values in cfg.items():
            out[section] = {**out.get(section, {}), **values}
    return out


def to_toml(cfg: dict) -> str:
    """Sections of scalars, lists and inline tables (all a node config holds) as TOML."""
    lines = []
    for section, values in cfg.items():
        lines.append(f"[{section}]")
        lines += [f"{key} = {_toml(value)}" for key, value in values.items()]
        lines.append("")
    return "\n".join(lines)


def _toml(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        if isinstance(value, float) and not math.isfinite(value):
            raise NetlabError(f"cannot write {value} to TOML")
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a TOML basic string (no DEL here)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{json.dumps(str(k))} = {_toml(v)}"
                                for k, v in value.items()) + " }"
    raise NetlabError(f"cannot write {type(value).__name__} to TOML")
