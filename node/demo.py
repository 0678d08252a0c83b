"""`swarm-node demo`: a complete local swarm on loopback, in separate processes.

One trainer, one relay, N honest inference peers and one dishonest inference peer (it
tampers with the tokens of its rollouts after sampling). Every node is a real
`swarm-node join` process with its own key, data dir and admin endpoint; they find each
other through the trainer's multiaddr. The demo watches their /status endpoints, shows
progress, and ends with a summary.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from rich.live import Live
from rich.table import Table

from .config import dump_toml
from .errors import NodeError
from .models import BUILTIN_SMOLLM2, build_tiny_model, ensure_builtin
from .tasks import SMALL_ARITHMETIC, PromptStyle

DEFAULT_ROUNDS = 20
MODELS = ("tiny", "smollm2")
# --model smollm2: the real model on arithmetic; few, slow rounds on a CPU
SMOLLM2_ROUNDS = 4
SMOLLM2_TASK = "rg/basic_arithmetic"
SMOLLM2_EVAL_TASKS, SMOLLM2_MAX_NEW = 32, 10  # "<answer>-8</answer>" is 9 tokens
SMOLLM2_SYSTEM_PROMPT, SMOLLM2_FEW_SHOT = "direct", 2
SMOLLM2_TIME_LIMIT_S = 3600.0
START_TIMEOUT_S = 120.0
DEFAULT_TIME_LIMIT_S = 900.0


@dataclass
class DemoNode:
    name: str
    role: str
    dir: Path
    dishonest: str = "none"
    proc: subprocess.Popen | None = None
    info: dict = field(default_factory=dict)
    last_status: dict = field(default_factory=dict)
    notices: socket.socket | None = None  # where the node says how far its start got

    @property
    def log_path(self) -> Path:
        return self.dir / "node.log"


def node_config(node: DemoNode, model_dir: Path, bootstrap: list[str], follow: list[str],
                swarm_id: str) -> dict:
    """The TOML config of one demo node: loopback only, small and fast settings."""
    cfg = {
        "node": {
            "role": node.role, "swarm_id": swarm_id, "data_dir": str(node.dir / "data"),
            "listen": ["/ip4/127.0.0.1/tcp/0"], "bootstrap": bootstrap, "follow": follow,
            "dishonest": node.dishonest,
        },
        "model": {"name": str(model_dir)},
        "admin": {"port": 0},
        "p2p": {"bootstrap_timeout_s": 60.0},
        "broadcast": {"shard_size": 64 * 1024},
        # The toy task: single-digit answers, so two new tokens (digit, EOS) suffice.
        "tasks": {"mix": {"toy/digit_successor": 1.0}, "tasks_per_round": 8},
        "sampler": {"completions_per_task": 8, "max_new_tokens": 2, "temperature": 1.0},
        # Peers' rollouts of this trainer's policy count as local items; one step uses up
        # to 16 groups and waits (up to 20 s) for a verified batch from a peer, so the
        # trainer does not race ahead of the swarm it trains with.
        "trainer": {"learning_rate": 3e-3, "local_items": 16, "external_items": 0,
                    "peer_batches_per_step": 1, "peer_wait_s": 20.0},
    }
    return cfg


def smollm2_settings(cfg: dict) -> dict:
    """The demo's node config for the real model: one-digit arithmetic, prompted with
    reasoning-gym's "direct" system prompt and two worked examples (so the model answers in
    the <answer> format it is scored on), short completions, shards for a 0.5 GB policy."""
    cfg["broadcast"] = {"shard_size": 16 * 1024 * 1024}
    cfg["tasks"] = {"mix": {SMOLLM2_TASK: 1.0}, "params": {SMOLLM2_TASK: SMALL_ARITHMETIC},
                    "tasks_per_round": 2, "system_prompt": SMOLLM2_SYSTEM_PROMPT,
                    "few_shot": SMOLLM2_FEW_SHOT}
    # groups of 8: with a few percent of rewarded completions, a group of 4 rarely carries
    # any signal (all-zero groups are dropped and the trainer cannot step)
    cfg["sampler"] = {"completions_per_task": 8, "max_new_tokens": SMOLLM2_MAX_NEW,
                      "temperature": 1.0}
    cfg["trainer"] = {**cfg["trainer"], "learning_rate": 2e-5, "micro_batch_size": 8,
                      "peer_wait_s": 120.0}
    return cfg


def start_node(node: DemoNode, cfg: dict) -> None:
    path, env = prepare_node(node, cfg)
    with open(node.log_path, "ab") as log:
        node.proc = subprocess.Popen(
            [sys.executable, "-m", "swarm_node.cli.main", "join", "--config", str(path)],
            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def prepare_node(node: DemoNode, cfg: dict) -> tuple[Path, dict[str, str]]:
    """A node's config file and start-notice socket; its config path and environment."""
    node.dir.mkdir(parents=True, exist_ok=True)
    path = node.dir / "node.toml"
    path.write_text(dump_toml(cfg))
    # the node's start notices (runner.notify_supervisor), on a socket of our own
    if node.notices is not None:  # a restarted node: a fresh socket
        node.notices.close()
    node.notices = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    name = f"swarm-demo-{os.getpid()}-{id(node):x}-{node.name}"
    node.notices.bind("\0" + name)
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", NOTIFY_SOCKET="@" + name)
    return path, env


def wait_info(node: DemoNode, timeout: float = START_TIMEOUT_S) -> dict:
    """Wait until the node wrote node.json (listening, admin up): its first start notice,
    or its exit, wakes this wait."""
    if node.proc is None or node.notices is None:
        raise NodeError(f"demo node {node.name} was not started (start_node)")
    exited = _exit_handle(node.proc)
    deadline = time.monotonic() + timeout
    try:
        while (left := deadline - time.monotonic()) > 0:
            # without a pidfd (not Linux) the exit is noticed at most a second late
            ready, _, _ = select.select([node.notices, *([exited] if exited else [])], [], [],
                                        left if exited is not None else min(left, 1.0))
            if node.proc.poll() is not None:
                raise NodeError(f"demo node {node.name} exited with code "
                                f"{node.proc.returncode}; its log:\n{tail(node.log_path)}")
            if node.notices in ready:
                node.notices.recv(4096)
                node.info = json.loads((node.dir / "data" / "node.json").read_text())
                return node.info
    finally:
        if exited is not None:
            os.close(exited)
    raise NodeError(f"demo node {node.name} did not start within {timeout:.0f}s; its log:\n"
                    f"{tail(node.log_path)}")


def _exit_handle(proc: subprocess.Popen) -> int | None:
    """A descriptor readable once `proc` exits (Linux pidfd), or None."""
    try:
        return os.pidfd_open(proc.pid)
    except (AttributeError, OSError):
        return None


def tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def fetch_status(node: DemoNode, timeout: float = 2.0) -> dict:
    port = node.info.get("admin_port")
    if not port:
        return {}
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=timeout) as r:
            node.last_status = json.loads(r.read())
    except (urllib.error.URLError, OSError, ValueError):
        pass
    return node.last_status


def stop_nodes(nodes: list[DemoNode], grace: float = 30.0) -> dict[str, int]:
    """SIGTERM each node (clean shutdown), then SIGKILL whatever is left after `grace`.
    Returns each node's exit code (0: it shut down cleanly)."""
    for node in nodes:
        if node.proc is not None and node.proc.poll() is None:
            node.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for node in nodes:
        if node.proc is None:
            continue
        try:
            node.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            node.proc.kill()
            node.proc.wait()
    for node in nodes:
        if node.notices is not None:
            node.notices.close()
            node.notices = None
    return {n.name: n.proc.returncode for n in nodes if n.proc is not None}


class Progress:
    """Live table in a terminal, a plain line every few seconds otherwise."""

    def __init__(self):
        self.tty = sys.stdout.isatty()
        self._live = None
        self._last_line = 0.0

    def __enter__(self):
        if self.tty:
            self._live = Live(refresh_per_second=2)
            self._live.__enter__()
        return self

    def __exit__(self, *exc):
        if self._live is not None:
            self._live.__exit__(*exc)

    def update(self, nodes: list[DemoNode], elapsed: float) -> None:
        if self._live is not None:
            self._live.update(render_table(nodes, elapsed))
        elif time.monotonic() - self._last_line > 5:
            self._last_line = time.monotonic()
            print(progress_line(nodes, elapsed), flush=True)


def waiting_for(nodes: list[DemoNode]) -> str:
    """What the swarm waits for before the first reward is known (the first minute)."""
    trainer = nodes[0].last_status
    if trainer.get("reward") is not None:
        return ""
    peers = [n for n in nodes[1:] if n.role == "inference"]
    if not trainer or trainer.get("phase") != "running":
        return "waiting for the trainer to load the model"
    loading = [n.name for n in peers if n.last_status.get("phase") != "running"]
    if loading:
        return f"waiting for {', '.join(loading)} to load the model"
    fresh = [n.name for n in peers if not n.last_status.get("policy_id")]
    if fresh:
        return f"waiting for {', '.join(fresh)} to download the trainer's v0"
    if not any(n.last_status.get("rollouts_sent") for n in peers):
        return "waiting for the inference peers' first rollouts"
    if not trainer.get("rollouts_accepted"):
        return "the trainer verifies the first rollouts (proof, logprobs, reward, ...)"
    return "waiting for the first training step"


def progress_line(nodes: list[DemoNode], elapsed: float) -> str:
    trainer = nodes[0].last_status
    wait = waiting_for(nodes)
    head = (f"[{elapsed:5.0f}s] trainer v{trainer.get('policy_version', '?')} "
            + (wait if wait else f"reward {_fmt(trainer.get('reward'))}"))
    parts = [head]
    for node in nodes[1:]:
        st = node.last_status
        if node.role == "inference":
            parts.append(f"{node.name}: v{st.get('policy_version', '?')} "
                         f"sent {st.get('rollouts_sent', 0)}")
    acc = trainer.get("accepted_by_peer", {})
    parts.append("accepted/rejected by peer: " + ", ".join(
        f"{_name(nodes, p)} {v.get('accepted', 0)}/{v.get('rejected', 0)}" for p, v in acc.items()))
    return " | ".join(parts)


def render_table(nodes: list[DemoNode], elapsed: float):
    trainer = nodes[0].last_status
    by_peer = trainer.get("accepted_by_peer", {})
    wait = waiting_for(nodes)
    table = Table(title=f"swarm-node demo, {elapsed:.0f}s: trainer policy "
                        f"v{trainer.get('policy_version', '?')}, "
                        + (wait if wait else f"reward {_fmt(trainer.get('reward'))}"))
    for col in ("node", "role", "policy", "sent", "accepted", "rejected", "peers", "note"):
        table.add_column(col)
    for node in nodes:
        st = node.last_status
        peer = node.info.get("peer_id", "")
        mine = by_peer.get(peer, {})
        note = "BANNED" if peer in trainer.get("banned", []) else (
            "dishonest" if node.dishonest != "none" else "")
        table.add_row(node.name, node.role, f"v{st.get('policy_version', '?')}",
                      str(st.get("rollouts_sent", "")), str(mine.get("accepted", "")),
                      str(mine.get("rejected", "")), str(len(st.get("peers", []) or [])), note)
    return table


def _fmt(x) -> str:
    return "?" if x is None else f"{x:.3f}"


def _name(nodes: list[DemoNode], peer: str) -> str:
    for node in nodes:
        if node.info.get("peer_id") == peer:
            return node.name
    return peer[-6:]


def summary(nodes: list[DemoNode], require_rise: bool = True) -> tuple[str, bool]:
    trainer = nodes[0].last_status
    history = trainer.get("reward_history", [])
    cheater = next((n for n in nodes if n.dishonest != "none"), None)
    cheater_id = cheater.info.get("peer_id") if cheater else None
    by_peer = trainer.get("accepted_by_peer", {})
    lines = ["", "swarm-node demo summary", "-----------------------"]
    first = history[0][1] if history else None
    last = (sum(r for _, r in history[-3:]) / len(history[-3:])) if history else None
    start = (sum(r for _, r in history[:3]) / len(history[:3])) if history else None
    lines.append(f"policy versions broadcast: {trainer.get('policy_version', 0)}")
    lines.append(f"mean reward: first step {_fmt(first)}, first 3 steps {_fmt(start)}, "
                 f"last 3 steps {_fmt(last)}")
    for node in nodes[1:]:
        if node.role != "inference":
            continue
        mine = by_peer.get(node.info.get("peer_id"), {})
        lines.append(f"{node.name:>12}: accepted {mine.get('accepted', 0)}, rejected "
                     f"{mine.get('rejected', 0)} {mine.get('reasons', {}) or ''}")
    banned = bool(cheater_id and cheater_id in trainer.get("banned", []))
    cheater_accepted = by_peer.get(cheater_id, {}).get("accepted", 0) if cheater_id else 0
    if cheater is not None:
        lines.append(f"dishonest peer: {'BANNED' if banned else 'not banned'}, "
                     f"{cheater_accepted} of its rollouts accepted")
        lines.extend(cheater_story(cheater, by_peer.get(cheater_id, {}), banned))
    rose = start is not None and last is not None and last > start
    lines.append(f"reward rose: {'yes' if rose else 'no'}")
    caught = cheater is None or (banned and cheater_accepted == 0)
    ok = (rose or not require_rise) and caught
    return "\n".join(lines), ok


def cheater_story(cheater: DemoNode, seen: dict, banned: bool) -> list[str]:
    """Why the cheater's numbers do not add up: what the trainer verified, what it refused
    unverified once the ban was in place, and what never reached it."""
    sent = int(cheater.last_status.get("rollouts_sent", 0) or 0)
    reasons = dict(seen.get("reasons") or {})
    dropped = reasons.pop("banned", 0)
    accepted = int(seen.get("accepted", 0) or 0)
    checked = accepted + sum(reasons.values())
    out = [(f"  it sent {sent} rollouts; the trainer verified {checked}: {accepted} accepted, "
            f"{sum(reasons.values())} rejected {reasons or ''}")]
    if banned:
        out.append(f"  then banned it: {dropped} more arrived and were refused unverified "
                   f"(reason 'banned'), and the other {max(0, sent - checked - dropped)} "
                   "were dropped at the gossip layer before the trainer saw them (a banned "
                   "peer's messages are not even validated)")
    return out


def demo_model(model: str, work: Path) -> Path:
    """The demo's model folder: the tiny model built into the workdir, or SmolLM2 from the
    builtin cache (converted once)."""
    if model not in MODELS:
        raise NodeError(f"demo --model must be one of {', '.join(MODELS)}")
    # a library progress bar ("Writing model shards") is not demo output
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if model == "smollm2":
        return ensure_builtin(BUILTIN_SMOLLM2)
    model_dir = work / "model"
    if not (model_dir / "config.json").exists():
        build_tiny_model(model_dir, seed=0)
    return model_dir


def held_out_report(model_dir: Path, trainer: DemoNode) -> list[str]:
    """Held-out greedy accuracy of the start policy and of the trainer's last checkpoint."""
    # torch loads in the demo's own process only for this final evaluation.
    from .trainer.checkpoint import CheckpointStore  # noqa: PLC0415
    from .trainer.evaluate import accuracy_of_model_dir, held_out_refs  # noqa: PLC0415

    refs = held_out_refs(SMOLLM2_TASK, SMOLLM2_EVAL_TASKS, SMALL_ARITHMETIC)
    style = PromptStyle(SMOLLM2_SYSTEM_PROMPT, SMOLLM2_FEW_SHOT)
    latest = CheckpointStore(trainer.dir / "data" / "trainer" / "checkpoints").latest()
    lines = [f"held-out greedy accuracy ({len(refs)} {SMOLLM2_TASK} tasks never trained on):"]
    for label, path in (("start", model_dir),
                        (f"end (v{latest.version})" if latest else "end", latest.policy_dir
                         if latest else None)):
        if path is None:
            lines.append(f"  {label}: no checkpoint")
            continue
        acc = accuracy_of_model_dir(path, refs, SMOLLM2_MAX_NEW, style=style,
                                    say=lambda line: print(line, flush=True))
        lines.append(f"  {label}: exact {acc['exact']:.3f}, <answer> tag {acc['tagged']:.3f}, "
                     f"last number right {acc['lenient']:.3f}")
    return lines


def watch(nodes: list[DemoNode], rounds: int, time_limit_s: float,
          cheat: DemoNode | None, t0: float) -> bool:
    """Poll every node until the trainer reached `rounds` versions and the cheater is banned
    (or the time limit). Returns True if Ctrl-C ended it."""
    trainer = nodes[0]
    try:  # "nodes up" inside: a Ctrl-C right after it is an interrupted run, not a start
        print(f"{len(nodes)} nodes up after {time.monotonic() - t0:.0f}s; training for "
              f"{rounds} policy versions", flush=True)
        with Progress() as progress:
            while True:
                for node in nodes:
                    fetch_status(node)
                    if node.proc is not None and node.proc.poll() is not None:
                        raise NodeError(f"demo node {node.name} exited (code "
                                        f"{node.proc.returncode}); its log:\n{tail(node.log_path)}")
                elapsed = time.monotonic() - t0
                progress.update(nodes, elapsed)
                st = trainer.last_status
                banned = cheat is None or cheat.info.get("peer_id") in st.get("banned", [])
                if st.get("policy_version", 0) >= rounds and banned:
                    return False
                if elapsed > time_limit_s:
                    print(f"time limit of {time_limit_s:.0f}s reached", flush=True)
                    return False
                time.sleep(1.0)  # the display's pace: /status of other processes, read
    except KeyboardInterrupt:
        print(f"\ninterrupted at trainer v{trainer.last_status.get('policy_version', 0)}",
              flush=True)
        return True


def run_demo(rounds: int = 0, inference_peers: int = 2, workdir: Path | None = None,
             time_limit_s: float | None = None, model: str = "tiny",
             cheater: bool = True) -> int:
    """The local swarm; without `cheater`, only honest peers (a learning swarm)."""
    # SIGTERM and SIGHUP (`timeout`, a closed terminal, a supervisor) stop it as Ctrl-C
    # does: the nodes run in their own sessions and would outlive the demo otherwise. Ctrl-C
    # works even when SIGINT was ignored on entry (a background job of a script).
    previous = {sig: signal.signal(sig, _interrupt)
                for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        return _run_demo(rounds, inference_peers, workdir, time_limit_s, model, cheater)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _run_demo(rounds: int, inference_peers: int, workdir: Path | None,
              time_limit_s: float | None, model: str, cheater: bool) -> int:
    rounds = rounds or (SMOLLM2_ROUNDS if model == "smollm2" else DEFAULT_ROUNDS)
    time_limit_s = time_limit_s or (SMOLLM2_TIME_LIMIT_S if model == "smollm2"
                                    else DEFAULT_TIME_LIMIT_S)
    if inference_peers < 1:
        raise NodeError("--inference-peers must be at least 1")
    work = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="swarm-demo-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"demo workdir: {work} (configs, logs and data of every node)")
    model_dir = demo_model(model, work)
    configure = smollm2_settings if model == "smollm2" else (lambda cfg: cfg)
    swarm_id = "demo"
    trainer = DemoNode("trainer", "trainer", work / "trainer")
    relay = DemoNode("relay", "relay", work / "relay")
    honest = [DemoNode(f"inference-{i + 1}", "inference", work / f"inference-{i + 1}")
              for i in range(inference_peers)]
    cheat = DemoNode("cheater", "inference", work / "cheater", dishonest="tamper_tokens")
    nodes = [trainer, relay, *honest] + ([cheat] if cheater else [])
    t0 = time.monotonic()
    interrupted = False
    try:
        start_node(trainer, configure(node_config(trainer, model_dir, [], [], swarm_id)))
        info = wait_info(trainer)
        boot = [info["listen_addrs"][0]]
        print(f"trainer {info['peer_id']} listening on {boot[0]}")
        for node in nodes[1:]:
            start_node(node, configure(node_config(node, model_dir, boot, [info["peer_id"]],
                                                   swarm_id)))
        for node in nodes[1:]:
            wait_info(node)
        interrupted = watch(nodes, rounds, time_limit_s, cheat if cheater else None, t0)
    except KeyboardInterrupt:
        interrupted = True
        print("\ninterrupted while starting the nodes", flush=True)
    finally:
        running = [n for n in nodes if n.proc is not None and n.proc.poll() is None]
        if running:
            print(f"stopping {len(running)} nodes (a clean shutdown each, up to 30 s; Ctrl-C "
                  "again kills them now) ...", flush=True)
        try:
            stop_nodes(nodes)
        except KeyboardInterrupt:
            stop_nodes(nodes, grace=0.0)
            print("killed the nodes", flush=True)
    text, ok = summary(nodes, require_rise=model != "smollm2")  # few rounds: no promise
    if interrupted:
        text += f"\n(interrupted after {time.monotonic() - t0:.0f}s: a partial run; workdir {work})"
    print(text)
    if interrupted:
        return 130
    if model == "smollm2":
        print("\n".join(held_out_report(model_dir, trainer)))
    return 0 if ok else 1
