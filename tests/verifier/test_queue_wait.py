"""Issue 30, fairness to newcomers: a batch is judged stale as of its arrival, not after its
wait in the trainer's verification queue. The real trainer role's intake over a real
Trainer (tiny model) and the real verifier; the trainer's versions move on (real steps,
real checkpoints and their retention) while a newcomer's batch waits in the probation
queue. Only the p2p host is a fake (no gossip plays a part here)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from swarm_node.node.config import Config
from swarm_node.node.identity import Identity
from swarm_node.node.metrics import NodeState
from swarm_node.verifier.intake import IntakeLimits
from swarm_node.verifier.reputation import Reputation
from swarm_node.verifier.rules import retention

from ..node.roles.fakes import FakeP2P
from ..node.trainer.helpers import mixed_group

NEWCOMER = "12D3KooWhonestNewcomer"
pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def config(tmp_path, keep: int = 1, **verifier) -> Config:
    return Config.model_validate({
        "node": {"data_dir": str(tmp_path / "trainer"), "role": "trainer", "swarm_id": "unit"},
        "model": {"device": "cpu"}, "verifier": verifier,
        "trainer": {"max_staleness": 1, "checkpoint_every": 1, "keep_checkpoints": keep,
                    "local_items": 1, "external_items": 1},
        "tasks": {"mix": {"toy/digit_successor": 1.0}, "tasks_per_round": 2},
        "sampler": {"completions_per_task": 2, "max_new_tokens": 8, "batches_per_version": 4,
                    "temperature": 1.0, "top_p": 1.0}})


async def trainer_role(cfg, tiny_model_dir):
    from swarm_node.node.roles.interfaces import OwnCheckpoints
    from swarm_node.node.roles.trainer import TrainerRole
    from swarm_node.node.tasks import TaskSource
    from swarm_node.node.trainer.trainer import Trainer

    ident = Identity.generate()
    role = TrainerRole(cfg, ident, FakeP2P(), NodeState(ident.peer_id, "trainer", "unit"))
    role.trainer = await role.work(Trainer, cfg, tiny_model_dir, role.data_dir,
                                   policy_id=ident.peer_id)
    # the real publisher's retention over the trainer's checkpoint store (no broadcaster:
    # nothing is published here)
    role.own = OwnCheckpoints(role.trainer, None, retention(cfg, role.trainer.store.keep))
    role.tasks = TaskSource(cfg.tasks.mix, cfg.node.swarm_id)
    # probation batches get no time share: they wait until the trainer is idle
    role.intake = role.build_intake(Reputation(None), limits=IntakeLimits(probation_burst_s=0))
    return role


def newcomer_batch(role, version: int, k: int):
    """An honest batch of `NEWCOMER`, sampled with the trainer's checkpoint of `version`
    (what a follower downloads)."""
    from swarm_node.node.models import load_model
    from swarm_node.node.sampler.factory import sampling_params
    from swarm_node.node.testing import attacks
    from swarm_node.verifier.rules import batch_rules

    cfg, policy = role.cfg, role.identity.peer_id
    model, tokenizer = load_model(role.own.path(policy, version))
    return attacks.sample_batch(model, tokenizer, role.tasks, NEWCOMER,
                                round_=batch_rules(cfg).round_for(version, k), version=version,
                                tasks=cfg.tasks.tasks_per_round,
                                n=cfg.sampler.completions_per_task,
                                params=sampling_params(cfg), swarm_id=cfg.node.swarm_id,
                                policy_id=policy)


async def offer(role, batch) -> None:
    await role.intake.offer(SimpleNamespace(sender=NEWCOMER, message=batch), "conn")


@pytest.mark.slow
async def test_1_a_newcomers_batch_is_judged_as_of_its_arrival(tmp_path, tiny_model_dir):
    """The newcomer's batch, fresh when it arrived, waits in the probation queue while the
    trainer steps past its lag limit (max_staleness 1: two versions): it used to be
    rejected `stale_policy` (-0.5, the newcomer charged for our queue) or, once its
    checkpoint was pruned, `unknown_policy`. Now it is verified and accepted, and its groups
    reach the trainer's buffer (they used to be dropped there as stale: credit for the
    sender, the data lost). Holding a batch back gains nothing (judged as of when it
    arrives), and the accepted one sent again is still a re-delivery."""
    cfg = config(tmp_path)
    role = await trainer_role(cfg, tiny_model_dir)
    try:
        trainer, intake = role.trainer, role.intake
        waiting = newcomer_batch(role, 0, 0)
        held = newcomer_batch(role, 0, 1)  # sampled now, sent only later
        await offer(role, waiting)
        for k in range(cfg.trainer.max_staleness + 1):  # the trainer moves on meanwhile
            assert trainer.add_local(mixed_group(trainer.tokenizer, k)) == 1
            assert (await role.work(trainer.step)).trained
            assert await intake.drain() == 0  # no probation share: it waits
        assert trainer.version == 2 and len(intake.queue) == 1
        before = trainer.counters()
        assert await intake.drain(idle=True) == 1  # the trainer idles: its turn
        peer = role.state.by_peer[NEWCOMER]
        assert (peer.accepted, dict(peer.reasons)) == (4, {}), dict(peer.reasons)
        assert intake.reputation.score(NEWCOMER) == pytest.approx(4.0, abs=0.01)
        # both groups reached the trainer: stored (2 versions of queue forgiven), or left
        # out for want of reward signal; none dropped stale
        after = trainer.counters()
        stored = [g for g in trainer.buffer.pending("local") if g.sender == NEWCOMER]
        assert [g.queued for g in stored] == [2] * len(stored)
        assert after.get("stored_queued", 0) == len(stored)
        assert len(stored) + after.get("dropped_zero_advantage", 0) \
            - before.get("dropped_zero_advantage", 0) == 2, after
        assert "dropped_stale" not in after
        # a batch of the same version held back until now: stale as of its arrival
        await offer(role, held)
        await intake.drain(idle=True)
        assert dict(peer.reasons) == {"stale_policy": 4}
        # the accepted batch again (a re-delivery, a replay): not judged at all
        await offer(role, waiting)
        await intake.drain(idle=True)
        assert peer.accepted == 4 and dict(peer.reasons) == {"stale_policy": 4}
        assert intake.batches["already_accepted"] == 1
    finally:
        role.trainer.close()


@pytest.mark.slow
async def test_2_the_configured_queue_grace_is_the_trainers(tmp_path, tiny_model_dir):
    """`verifier.queue_grace` is a setting: at 0 the same newcomer's batch, fresh when it
    arrived, is `queue_expired` once the trainer stepped past its lag limit (not verified,
    no penalty, its budget refunded), although its checkpoint is still kept here
    (keep_checkpoints 4); and the retention follows it (max_staleness + 1 + 0)."""
    assert retention(config(tmp_path, queue_grace=0), 1) == 2
    cfg = config(tmp_path, keep=4, queue_grace=0)
    role = await trainer_role(cfg, tiny_model_dir)
    try:
        trainer, intake = role.trainer, role.intake
        assert trainer.store.keep == 4
        await offer(role, newcomer_batch(role, 0, 0))
        for k in range(cfg.trainer.max_staleness + 1):
            assert trainer.add_local(mixed_group(trainer.tokenizer, k)) == 1
            assert (await role.work(trainer.step)).trained
        assert await intake.drain(idle=True) == 1
        peer = role.state.by_peer[NEWCOMER]
        assert (peer.accepted, dict(peer.reasons)) == (0, {"queue_expired": 4})
        assert intake.batches["queue_expired"] == 1
        assert intake.reputation.score(NEWCOMER) == 0.0
        assert role.own.path(role.identity.peer_id, 0) is not None  # the model was there
    finally:
        role.trainer.close()
