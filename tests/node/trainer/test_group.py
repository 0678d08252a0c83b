"""Trainer groups: real trainer processes, each with its real hivemind child, on loopback.

One scenario (process start-up dominates the cost): A and B average after a step and publish
identical weights; C joins late and starts from that averaged state; X, with the wrong key,
gets no state and no round; B is SIGKILLed during a round and A and C carry on, averaging
between them. The four processes start together (each builds its trainer meanwhile) and
join the group when the scenario says so.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from swarm_node.node.trainer.group import GroupError, read_group_key, write_group_key

from tests.launch import PIPE, start_program

TIMEOUT_S = 15.0
WAIT_S = 2 * TIMEOUT_S + 90  # one round, on a busy machine
# X (the wrong key) waits out its round's timeout (no member answers it): with the group's
# 15 s that was the end of step 3. With 4 s (1 s matchmaking) it still looks for a group
# while A, B and C form theirs: a round key check that let it in fails the test (checked by
# making the check pass everyone).
X_TIMEOUT_S = 4.0


class Member:
    def __init__(self, name: str, tmp: Path, model_dir: Path, key: Path, first_task: int,
                 timeout_s: float = TIMEOUT_S):
        self.name, self.data = name, tmp / name
        settings = {"data_dir": str(self.data), "model_dir": str(model_dir), "group": "g1",
                    "key_path": str(key), "timeout_s": timeout_s, "first_task": first_task}
        self.log = tmp / f"{name}.log"
        # forked warm (tests/launch.py: torch, transformers and the trainer already imported,
        # ~9 s of CPU a member less), in its own session: kill() reaches its hivemind child
        self.proc = start_program(
            module="tests.node.trainer.group_member", argv=[json.dumps(settings)],
            stdin=PIPE, stdout=PIPE, stderr=self.log, new_session=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"})
        self.events: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.events.put(json.loads(line))
        self.events.put({"event": "exited"})

    def expect(self, event: str, timeout: float = WAIT_S) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:
                msg = self.events.get(timeout=max(left, 0.01))
            except queue.Empty:
                pytest.fail(f"{self.name}: no {event!r} in {timeout:.0f} s; log: {self.log}")
            if msg["event"] == event:
                return msg
            if msg["event"] == "exited":
                pytest.fail(f"{self.name} exited; log: {self.log}")

    def send(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def join(self, peers: list[str]) -> dict:
        """Join the group (start its hivemind child, load the group's state): the reply."""
        self.expect("started")
        self.send(f"join {json.dumps(peers)}")
        return self.expect("ready")

    def weights(self, version: int) -> dict[str, torch.Tensor]:
        ck = self.data / "trainer" / "checkpoints" / f"step-{version:08d}" / "policy"
        return load_file(str(ck / "model.safetensors"))

    def current(self, path: Path) -> dict[str, torch.Tensor]:
        self.send(f"dump {path}")
        self.expect("dumped")
        return load_file(str(path))

    def kill(self) -> None:
        """SIGKILL the member, its hivemind child and the child's daemons."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()

    def stop(self) -> None:
        """Clean-up: SIGKILL (the scenario asserts nothing about leaving; a clean exit, which
        waits for hivemind's shutdown, costs seconds per member)."""
        self.kill()
        self.proc.stdin.close()


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k, v in a.items():
        torch.testing.assert_close(v, b[k], rtol=0, atol=1e-6, msg=k)


def test_group_key_file_rules(tmp_path):
    key = tmp_path / "group.key"
    write_group_key(key)
    assert len(read_group_key(key)) == 32
    os.chmod(key, 0o644)
    with pytest.raises(GroupError, match="chmod 600"):
        read_group_key(key)


@pytest.mark.slow
def test_group_averages_survives_a_death_and_catches_up_a_late_joiner(tiny_model_dir,
                                                                      tmp_path):
    key, wrong = tmp_path / "group.key", tmp_path / "wrong.key"
    write_group_key(key)
    write_group_key(wrong)
    members: list[Member] = []
    try:
        for name, k, first_task, timeout_s in (("a", key, 0, TIMEOUT_S),
                                               ("b", key, 100, TIMEOUT_S),
                                               ("c", key, 200, TIMEOUT_S),
                                               ("x", wrong, 300, X_TIMEOUT_S)):
            members.append(Member(name, tmp_path, tiny_model_dir, k, first_task, timeout_s))
        a, b, c, x = members
        peers = a.join([])["maddrs"]
        assert a.events.empty()
        b.join(peers)

        # 1. one step each on different data, then one round: identical published weights
        a.send("step")
        b.send("step")
        ra, rb = a.expect("stepped"), b.expect("stepped")
        assert ra["group"]["ok"] and rb["group"]["ok"], (ra, rb)
        assert ra["group"]["group_size"] == rb["group"]["group_size"] == 2
        averaged = a.weights(1)
        assert_same(b.weights(1), averaged)
        assert any(not torch.equal(averaged[k], a.weights(0)[k]) for k in averaged)

        # 2. a late joiner starts from the group's latest averaged state
        # (and one without the group's key, joining beside it, gets nothing)
        c.expect("started")
        x.expect("started")
        c.send(f"join {json.dumps(peers)}")
        x.send(f"join {json.dumps(peers)}")
        assert c.expect("ready")["loaded"]["ok"]
        assert_same(c.current(tmp_path / "c.safetensors"), averaged)
        assert not x.expect("ready")["loaded"]["ok"]

        # 3. B dies during a round: A and C finish that round without stalling; X (wrong
        # key) looks for a group at the same time and is never averaged with ...
        for m in (a, b, c, x):
            m.send("step")
        b.expect("averaging")
        b.kill()
        ra, rc = a.expect("stepped"), c.expect("stepped")
        assert (ra["version"], rc["version"]) == (2, 1)  # C joined one step later
        assert x.expect("stepped")["group"]["ok"] is False
        x.kill()
        # ... and carry on averaging between the two of them
        a.send("step")
        c.send("step")
        ra, rc = a.expect("stepped"), c.expect("stepped")
        assert ra["group"]["ok"] and rc["group"]["ok"], (ra, rc)
        assert ra["group"]["group_size"] == rc["group"]["group_size"] == 2
        assert_same(a.weights(3), c.weights(2))
    finally:
        for m in members:
            m.stop()
