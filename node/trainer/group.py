"""Trainer groups: several trainer nodes average their parameters every k steps (hivemind).

    [trainer]
    group = "lab-a"              # members share the name and the key file
    group_every = 10             # average after every 10th step (a multiple of checkpoint_every)
    group_key_path = "group.key" # 32 random bytes, hex; the same file on every member
    group_peers = ["/ip4/10.0.0.5/tcp/40000/p2p/Qm..."]   # another member's hivemind address

Each member trains on its own swarm and rollouts; after every `group_every`-th step it puts its
parameters into a shared memory file and asks its hivemind child process (group_worker.py) for
one averaging round (hivemind's DecentralizedAverager: matchmaking over hivemind's DHT, then a
butterfly all-reduce). The averaged parameters replace the member's own before that step's
checkpoint, so every member publishes the averaged weights as its own next version; the local
optimizer state is kept (local-SGD style). A round that finds no other member, or whose members
die, ends after `group_timeout_s`; the member then carries on with its own weights. On start a
member loads the group's latest averaged state from a member that has one (a late joiner
catches up). hivemind runs in a child process because it cannot share a process with
py-libp2p. How membership is authenticated: group_worker.py and NODE_SPEC.md.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import re
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import torch

from .group_key import GroupError, read_group_key, write_group_key  # noqa: F401 - re-exported

log = logging.getLogger(__name__)

NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
START_TIMEOUT_S = 120.0   # the child imports hivemind (~6 s) and starts its daemon
REPLY_MARGIN_S = 30.0     # beyond the averaging timeouts, before the child is declared hung


def schema_id(model) -> str:
    """Names and shapes of the parameters: members of different models never meet."""
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(f"{name}:{tuple(p.shape)};".encode())
    return h.hexdigest()[:12]


class TrainerGroup:
    """The trainer's handle on its hivemind child; `after_step` is the Trainer seam."""

    def __init__(self, model, *, name: str, key: bytes, every: int, timeout_s: float,
                 initial_peers: list[str], host_maddrs: list[str], state_dir: Path,
                 matchmaking_s: float | None = None, target_size: int | None = None):
        if not NAME_RE.match(name):
            raise GroupError(f"group name {name!r}: use 1-64 of A-Z a-z 0-9 _ -")
        self.name, self.every, self.timeout_s = name, every, timeout_s
        self.params = list(model.parameters())
        self.numel = sum(p.numel() for p in self.params)
        self.rounds_ok = self.rounds_failed = 0
        self.last: dict = {}
        self.load_reply: dict = {}
        state_dir.mkdir(parents=True, exist_ok=True)
        shm_dir = "/dev/shm" if os.path.isdir("/dev/shm") else str(state_dir)
        fd, self.shm_path = tempfile.mkstemp(prefix="swarm-node-group-", dir=shm_dir)
        os.ftruncate(fd, self.numel * 4)
        os.close(fd)
        self.shm = torch.from_file(self.shm_path, shared=True, size=self.numel,
                                   dtype=torch.float32)
        self.replies: queue.Queue = queue.Queue()
        matchmaking_s = matchmaking_s or min(5.0, timeout_s / 4)
        settings = {"name": name, "key": key.hex(), "numel": self.numel, "shm": self.shm_path,
                    "prefix": f"swarm-node-group-{name}-{schema_id(model)}",
                    "initial_peers": initial_peers, "host_maddrs": host_maddrs,
                    "identity_path": str(state_dir / "hivemind.key"),
                    "timeout_s": timeout_s, "matchmaking_s": matchmaking_s,
                    "target_size": target_size}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "swarm_node.node.trainer.group_worker"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        threading.Thread(target=self._read, daemon=True, name="group-reader").start()
        self._send(settings)
        ready = self._reply(START_TIMEOUT_S)
        if ready is None or ready.get("event") != "ready":
            self.close()
            raise GroupError("the trainer-group process did not start (is hivemind installed? "
                             "pip install 'swarm-node[group]'; its error is in the log above)")
        # Both processes have it mapped now: unlink the name, so that even a SIGKILLed
        # trainer leaves nothing behind in /dev/shm.
        os.unlink(self.shm_path)
        self.peer_id, self.maddrs = ready["peer_id"], ready["maddrs"]
        log.info("trainer group %r: hivemind peer %s at %s", name, self.peer_id, self.maddrs)

    # the pipe -----------------------------------------------------------------------------

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                self.replies.put(json.loads(line))
            except ValueError:
                log.warning("group process wrote a non-JSON line: %.200s", line)
        self.replies.put(None)  # EOF: the child exited

    def _send(self, msg: dict) -> None:
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()

    def _reply(self, timeout: float) -> dict | None:
        try:
            return self.replies.get(timeout=timeout)
        except queue.Empty:
            return None

    def _call(self, msg: dict, timeout: float) -> dict:
        if self.proc.poll() is not None:
            return {"ok": False, "error": f"group process exited ({self.proc.returncode})"}
        try:
            self._send(msg)
        except OSError as e:
            return {"ok": False, "error": f"group process unreachable: {e}"}
        reply = self._reply(timeout)
        if reply is None:
            self.close()  # hung or dead: the trainer carries on alone
            return {"ok": False, "error": "no answer from the group process; left the group"}
        return reply

    # parameters <-> shared memory --------------------------------------------------------

    @torch.no_grad()
    def _to_shm(self) -> None:
        offset = 0
        for p in self.params:
            self.shm[offset:offset + p.numel()].copy_(p.detach().reshape(-1))
            offset += p.numel()

    @torch.no_grad()
    def _from_shm(self) -> None:
        offset = 0
        for p in self.params:
            p.copy_(self.shm[offset:offset + p.numel()].view_as(p))
            offset += p.numel()

    # what the trainer calls ---------------------------------------------------------------

    def load_latest(self) -> dict:
        """Adopt the group's latest averaged state if a member serves one."""
        reply = self._call({"cmd": "load"}, self.timeout_s + REPLY_MARGIN_S)
        self.load_reply = reply
        if reply.get("ok"):
            self._from_shm()
            log.info("trainer group %r: loaded the averaged state of version %s from %s",
                     self.name, reply.get("version"), reply.get("peer"))
        return reply

    def average(self, version: int) -> dict:
        """One averaging round; on success the model holds the group's average."""
        self._to_shm()
        reply = self._call({"cmd": "average", "version": version},
                           2 * self.timeout_s + REPLY_MARGIN_S)
        if reply.get("ok"):
            self._from_shm()
            self.rounds_ok += 1
        else:
            self.rounds_failed += 1
        self.last = {**reply, "version": version}
        log.info("trainer group %r: round at v%d %s (%s members, %.1f s)%s", self.name, version,
                 "averaged" if reply.get("ok") else "not averaged", reply.get("group_size", 1),
                 reply.get("seconds", 0.0),
                 f": {reply.get('error')}" if not reply.get("ok") else "")
        return reply

    def after_step(self, trainer) -> None:
        """Trainer.after_step: average after every `every`-th version, before its checkpoint.
        With several ranks (distributed.py) rank 0 then hands the new weights to the others."""
        if trainer.version % self.every != 0:
            return
        if self.average(trainer.version).get("ok") and trainer.grad_sync is not None:
            trainer.grad_sync.send_params(trainer.model)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self._send({"cmd": "quit"})
                self.proc.stdin.close()
                self.proc.wait(timeout=15)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        try:
            os.unlink(self.shm_path)
        except FileNotFoundError:
            pass


def attach_group(trainer, cfg, data_dir: Path) -> TrainerGroup | None:
    """`trainer.group` set: start the group child and load the group's latest averaged state
    into `trainer`'s model; its `after_step` (the trainer's hook, hooks.py) averages every
    `group_every` steps. Returns None when no group is configured."""
    tc = cfg.trainer
    if not tc.group:
        return None
    if tc.group_every % tc.checkpoint_every != 0:
        raise GroupError("trainer.group_every must be a multiple of trainer.checkpoint_every "
                         "(the averaged weights are published as a checkpoint)")
    key_path = Path(tc.group_key_path).expanduser()
    if not key_path.is_absolute():
        key_path = Path(data_dir) / key_path
    group = TrainerGroup(trainer.model, name=tc.group, key=read_group_key(key_path),
                         every=tc.group_every, timeout_s=tc.group_timeout_s,
                         initial_peers=list(tc.group_peers), host_maddrs=list(tc.group_listen),
                         state_dir=Path(data_dir) / "trainer" / "group")
    group.load_latest()
    return group
