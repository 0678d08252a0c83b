"""Issue 11 finding 11 on the sender's side: an inference peer uses at most
`sampler.batches_per_version` rounds per policy version (the window BatchRules gives the
version) and then waits for the next version instead of sampling rounds a verifier would
reject as `round_out_of_range`. Runs the real inference role with the tiny model against the
in-memory feed and sink of tests/node/roles/fakes.py."""

from __future__ import annotations

import asyncio

import pytest
from swarm_node.node.config import Config
from swarm_node.node.identity import Identity
from swarm_node.node.metrics import NodeState
from swarm_node.node.models import build_tiny_model
from swarm_node.node.roles.inference import InferenceRole
from swarm_node.verifier.rules import batch_rules

from tests.node.roles.fakes import FakeFeed, FakeP2P, RecordingSink

TRAINER = "12D3KooWtrainerFollowed"
HANG_GUARD_S = 60  # a bound against a hang, not a timing assertion
K = 2  # rounds per version


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpts")
    return {v: build_tiny_model(root / f"v{v}", seed=v) for v in (1, 2)}


async def test_inference_waits_for_the_next_version_after_its_rounds(
        tmp_path, tiny_model_dir, checkpoints):
    cfg = Config.model_validate({
        "node": {"data_dir": str(tmp_path), "role": "inference", "follow": [TRAINER],
                 "swarm_id": "unit"},
        "model": {"name": str(tiny_model_dir), "device": "cpu"},
        "tasks": {"tasks_per_round": 1},
        "sampler": {"backend": "hf", "completions_per_task": 2, "max_new_tokens": 4,
                    "batches_per_version": K, "version_wait_s": 0.05}})
    feed, stop = FakeFeed(tmp_path, follow=[TRAINER], chosen=TRAINER), asyncio.Event()
    sink = RecordingSink(lambda batch, n: stop.set() if batch.policy_version == 2 else None)
    ident = Identity.generate()
    role = InferenceRole(cfg, ident, FakeP2P(), NodeState(ident.peer_id, "inference", "unit"),
                         feed=feed, sink=sink)
    waits = []
    next_round = role._next_round

    def spy(*args):  # records each time the role finds its version's rounds used up
        round_ = next_round(*args)
        if round_ is None:
            waits.append(len(sink.batches))
        return round_

    role._next_round = spy
    await role.start()
    try:
        feed.deliver(TRAINER, 1, checkpoints[1])
        run = asyncio.create_task(role.run(stop))
        deadline = asyncio.get_running_loop().time() + HANG_GUARD_S
        while len(waits) < 3:  # it keeps waiting (version_wait_s timeouts), never samples
            assert asyncio.get_running_loop().time() < deadline and not run.done()
            await asyncio.sleep(0.01)
        assert waits == [K] * len(waits)
        assert [(b.policy_version, b.round) for b in sink.batches] == \
            [(1, r) for r in batch_rules(cfg).round_window(1)]
        feed.deliver(TRAINER, 2, checkpoints[2])
        await asyncio.wait_for(run, HANG_GUARD_S)
    finally:
        await role.close()
    window_2 = batch_rules(cfg).round_window(2)
    assert [(b.policy_version, b.round) for b in sink.batches][K:] == [(2, window_2.start)]
