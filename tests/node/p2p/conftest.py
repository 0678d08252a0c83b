from __future__ import annotations

import asyncio
import json
import os
import tempfile
from pathlib import Path

import numpy as np
import pytest
from swarm_node.node.config import Config, load_config
from swarm_node.node.identity import Identity
from swarm_node.protocol.messages import (
    Completion,
    RolloutBatch,
    SamplingParams,
    TaskRef,
    TensorData,
    Verdict,
)

from tests.launch import PIPE, start_program
from tests.waiting import async_wait_until

PEER_PROC = Path(__file__).with_name("peer_proc.py")


SUBJECT = Identity.generate().peer_id  # the peer the test verdicts are about


def verdict(i: int, subject: str = SUBJECT) -> Verdict:
    """A small valid message for the "verdicts" topic; `policy_version` carries `i`."""
    return Verdict(rollout_id=i.to_bytes(32, "big"), subject=subject, accept=True,
                   reason="ok", policy_version=i)


def one_completion_batch(policy_id: str, completion_ids: np.ndarray, logprobs: np.ndarray,
                         round_: int = 0) -> RolloutBatch:
    """A valid RolloutBatch (toy/digit_successor) of one completion with the given arrays:
    its size on the wire is about 8 bytes per completion token."""
    comp = Completion(task=TaskRef(dataset="toy/digit_successor", seed=1, index=round_),
                      prompt_ids=TensorData.from_numpy(np.arange(8, dtype=np.int32)),
                      completion_ids=TensorData.from_numpy(completion_ids),
                      logprobs=TensorData.from_numpy(logprobs), finish_reason="length",
                      seed=3, claimed_reward=0.5)
    return RolloutBatch(swarm_id="default", round=round_, policy_id=policy_id,
                        policy_version=0, sampling=SamplingParams(), completions=[comp])


def rejects_by_sender(metrics, sender: str) -> dict[str, int]:
    """Gossip rejects charged to `sender`, by reason (P2PMetrics.rejects)."""
    return {reason: n for (s, reason), n in list(metrics.rejects.items()) if s == sender}


def drops(metrics) -> int:
    """Messages dropped for a full queue or size, all `drop_*` counters together."""
    return sum(n for k, n in list(metrics.counters.items()) if k.startswith("drop_"))


def p2p_config(node: dict | None = None, **p2p) -> Config:
    """A loopback test config: `p2p` overrides p2p.<k> (bulk.<rest> for bulk_<rest>), `node`
    the node section ({"swarm_id": ..., "role": ...}). The bootstrap may take 30 s: a
    deadline for the harness, not a claim (it returns at the first answer); 5 s ran out on
    a loaded CI machine while a test process ran 20 nodes (test_sybil_floods)."""
    overrides = {"node.listen": ["/ip4/127.0.0.1/tcp/0"], "p2p.discovery_interval_s": 0.5,
                 "p2p.bootstrap_timeout_s": 30, "p2p.dial_timeout_s": 3, "p2p.mesh_wait_s": 5}
    overrides |= {f"node.{k}": v for k, v in (node or {}).items()}
    for k, v in p2p.items():  # p2p.<k>, or bulk.<rest> for bulk_<rest>
        overrides[f"bulk.{k.removeprefix('bulk_')}" if k.startswith("bulk_") else f"p2p.{k}"] = v
    return load_config(None, overrides)


@pytest.fixture
async def make_node():
    """Factory of started P2PNodes on loopback; all are closed at the end of the test."""
    from swarm_node.node.p2p import P2PNode

    nodes = []

    async def make(identity=None, bootstrap=None, discovery=True, node=None, **p2p):
        started = P2PNode(identity or Identity.generate(), p2p_config(node, **p2p))
        await started.start(bootstrap=bootstrap or [], discovery=discovery)
        nodes.append(started)
        return started

    yield make
    await asyncio.gather(*(node.close() for node in nodes))


class PeerProcess:
    """A peer_proc.py subprocess; `stop()` closes its stdin and returns its final report.
    Its log (stderr) goes to a temporary file, never to an unread pipe: a full pipe blocks
    the process at its next log line (its libp2p thread included)."""

    def __init__(self, *args: str):
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self._log = tempfile.TemporaryFile("w+")  # noqa: SIM115 - read after stop(); GC closes
        # forked warm (tests/launch.py: ~2 s of CPU importing py-libp2p saved)
        self.proc = start_program(path=PEER_PROC, argv=list(args), env=env, stdin=PIPE,
                                  stdout=PIPE, stderr=self._log.fileno())
        self.info: dict = {}

    def stderr_tail(self, n: int = 3000) -> str:
        self._log.seek(0)
        return self._log.read()[-n:]

    async def ready(self, timeout: float = 60) -> dict:
        line = await asyncio.wait_for(asyncio.to_thread(self.proc.stdout.readline), timeout)
        if not line:
            raise RuntimeError(f"peer process died: {self.stderr_tail()}")
        self.info = json.loads(line)
        return self.info

    async def stop(self, timeout: float = 30) -> dict:
        try:
            self.proc.stdin.close()
            out = await asyncio.wait_for(asyncio.to_thread(self.proc.stdout.read), timeout)
            await asyncio.wait_for(asyncio.to_thread(self.proc.wait), timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
        lines = [ln for ln in out.splitlines() if ln.startswith("{")]
        return json.loads(lines[-1]) if lines else {}


async def ignore(env, peer) -> None:
    """A gossip handler for a topic a node subscribes to only to be in its mesh."""


async def wait_until(pred, timeout: float = 20, interval: float = 0.05, what: str = "condition"):
    """tests/waiting.py's `async_wait_until` with this package's defaults: for py-libp2p
    state (connections, meshes, counters) that nothing signals to the asyncio side."""
    return await async_wait_until(pred, timeout, what, interval=interval)


async def drop_warm_connection(puller, server) -> None:
    """Wait for `puller`'s warm-up towards `server` (BodyPuller.warm, at connect time),
    then close the bulk connection it pooled: for tests that change how `server` answers,
    so that the next pull opens a connection the changed server handles."""
    await wait_until(lambda: puller.metrics["payload_bulk_warmed"]
                     + puller.metrics["payload_bulk_warm_failed"] >= 1, 10, what="the warm-up")
    puller.bulk.client.forget_idle(server.peer_id, "body")
