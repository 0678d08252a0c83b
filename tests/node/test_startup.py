"""A node's start-up order (issue #27: a NAT'd peer must contribute within 60 s of its start).

The role's model loads while the host dials its bootstrap peers: a bootstrap peer that is slow
to answer (4-11 s in the WAN lab) no longer delays the load by as long. What needs the swarm
(the rest of the role's start, "joined swarm") still waits for the bootstrap to end.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

import pytest

from tests.launch import start_join
from tests.waiting import wait_until

BIN = Path(sys.executable).parent / "swarm-node"
FAKE_PEER = "12D3KooWNgpKH2Luu1kDmhJkc6dRcL7Q5n3mfKxpFDzk9oARbA2S"


def _ended(conn: socket.socket) -> bool:
    """The peer closed `conn` (what it sent meanwhile is read and dropped)."""
    try:
        while True:
            if not conn.recv(4096):
                return True
    except BlockingIOError:
        return False
    except OSError:
        return True


def _model_loaded(data_dir: Path) -> bool:
    """The role's model load ended: its duration is kept for the next start's ETA
    (node/trainer/progress.py Stage, key `model_load`)."""
    try:
        return "model_load" in json.loads((data_dir / "stages.json").read_text())
    except (OSError, ValueError):
        return False


@pytest.mark.parametrize("role", ["inference", "trainer"])
def test_model_loads_while_a_bootstrap_peer_does_not_answer(tmp_path, role):
    """Its only bootstrap peer accepts the TCP connection and never answers (the dial waits
    out its 60 s timeout): the model (a trainer's: with its state) is loaded while that dial
    still hangs, and the node is not announced as joined. Before, the role (and its model
    load) started only once the bootstrap ended, here with the node exiting on the bootstrap
    error."""
    data = tmp_path / "d"
    log = tmp_path / "node.log"
    env = {**os.environ, "HOME": str(tmp_path), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        silent.settimeout(120)
        addr = f"/ip4/127.0.0.1/tcp/{silent.getsockname()[1]}/p2p/{FAKE_PEER}"
        proc = start_join(BIN, ["join", "--role", role, "--data-dir", str(data),
                                "--listen", "/ip4/127.0.0.1/tcp/0", "--admin-port", "0",
                                "--bootstrap", addr, "--set", "p2p.bootstrap_timeout_s=60",
                                "--set", "p2p.dial_timeout_s=60"], env, log)
        try:
            conn, _ = silent.accept()  # the node's bootstrap dial
            with conn:
                conn.setblocking(False)
                wait_until(lambda: _model_loaded(data) or _ended(conn)
                           or proc.poll() is not None, 180,
                           "the model loaded, or the bootstrap dial ended",
                           details=lambda: log.read_text()[-3000:])
                text = log.read_text()
                assert _model_loaded(data), f"the model loaded only after the bootstrap\n{text}"
                assert not _ended(conn) and proc.poll() is None, text[-3000:]
                assert "joined swarm" not in text and "peer ready" not in text, text
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)
