"""Issue 11 finding 12 / issue 17 finding 8 over real libp2p: while sybils send bogus
batches (random tokens, valid tasks, prompts, seeds and proof length, so each costs a
forward pass), an established honest peer's batches are all verified and accepted, almost
no flood batch reaches the model first, and the connections that carried the flood are
penalised. Each sybil publishes as its own libp2p peer: the transport rejects (and
penalises) an envelope whose signer is not the gossip origin (`sender_mismatch`), so a
fresh envelope key needs a matching libp2p key.

The trainer side is the real TrainerRole wiring of the real intake (verifier/intake.py: the
fair queue, budgets, the real verifier and the real Trainer on the tiny model); only the
checkpoint broadcaster, which plays no part in verification of the trainer's own policy, is
left out.
"""

from __future__ import annotations

import asyncio
import random

import pytest
import torch
from swarm_node.node.config import Config, load_config
from swarm_node.node.identity import Identity
from swarm_node.node.testing import attacks
from swarm_node.protocol.messages import SamplingParams
from swarm_node.verifier.rules import batch_rules

from ..waiting import async_wait_until

HONEST_BATCHES = 4
SYBILS = 5
PER_SYBIL = 8  # = batches_per_version: every round of version 0
FLOOD_BATCHES = SYBILS * PER_SYBIL


def config(tmp_path) -> Config:
    return load_config(None, {
        "node.listen": ["/ip4/127.0.0.1/tcp/0"], "node.data_dir": str(tmp_path / "trainer"),
        "p2p.discovery_interval_s": 0.5, "p2p.bootstrap_timeout_s": 30, "p2p.mesh_wait_s": 5,
        "tasks.mix": {"toy/digit_successor": 1.0}, "tasks.tasks_per_round": 2,
        "sampler.completions_per_task": 2, "sampler.max_new_tokens": 8,
        "sampler.batches_per_version": 8, "sampler.temperature": 1.0, "sampler.top_p": 1.0})


async def started(cfg, identity=None, bootstrap=None):
    from swarm_node.node.p2p import P2PNode

    node = P2PNode(identity or Identity.generate(), cfg)
    await node.start(bootstrap=bootstrap or [], discovery=True)
    return node


async def trainer_role(cfg, tiny_model_dir, p2p, identity):
    from swarm_node.node.metrics import NodeState
    from swarm_node.node.roles.trainer import TrainerRole
    from swarm_node.node.tasks import TaskSource
    from swarm_node.node.trainer.trainer import Trainer
    from swarm_node.verifier.reputation import Reputation

    role = TrainerRole(cfg, identity, p2p, NodeState(identity.peer_id, "trainer",
                                                     cfg.node.swarm_id))
    role.trainer = await role.work(Trainer, cfg, tiny_model_dir, role.data_dir,
                                   policy_id=identity.peer_id)
    role.tasks = TaskSource(cfg.tasks.mix, cfg.node.swarm_id)
    role.intake = role.build_intake(Reputation(None))
    role.arrivals = []

    async def on_rollouts(env, from_peer):
        role.arrivals.append(env.sender)
        await role.intake.offer(env, from_peer)

    await p2p.subscribe("rollouts", on_rollouts)
    return role


@pytest.mark.slow
async def test_honest_batches_accepted_during_a_fresh_key_flood(tmp_path, tiny_model_dir):
    from swarm_node.node.models import load_model
    from swarm_node.node.tasks import TaskSource

    torch.set_num_threads(1)
    cfg = config(tmp_path)
    trainer_id = Identity.generate()
    hub = await started(cfg, trainer_id)
    honest_node = await started(cfg, bootstrap=hub.listen_addrs)
    sybils = [await started(cfg, bootstrap=hub.listen_addrs) for _ in range(SYBILS)]
    role = None
    try:
        role = await trainer_role(cfg, tiny_model_dir, hub, trainer_id)
        # history: the honest peer's earlier work was accepted (it is out of probation)
        for _ in range(role.intake.reputation.probation_accepts):
            role.intake.reputation.record(honest_node.peer_id, True)
        order = []
        real_for = role.verifier_for

        class Spy:
            def __init__(self, real):
                self.real = real

            def latest_version(self):
                return self.real.latest_version()

            def verify(self, batch, sender, *args):
                order.append(sender)
                return self.real.verify(batch, sender, *args)

        role.verifier_for = lambda policy_id: Spy(real_for(policy_id))

        model, tokenizer = load_model(tiny_model_dir)
        source = TaskSource(cfg.tasks.mix, cfg.node.swarm_id)
        rules = batch_rules(cfg)
        params = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=8)
        honest = [attacks.sample_batch(model, tokenizer, source, honest_node.peer_id,
                                       round_=rules.round_for(0, k), version=0, tasks=2, n=2,
                                       params=params, policy_id=trainer_id.peer_id)
                  for k in range(HONEST_BATCHES + 1)]
        honest, after = honest[:HONEST_BATCHES], honest[HONEST_BATCHES]
        rng = random.Random(0)

        def flood_batches(sybil):
            return [attacks.bogus_round(tokenizer, source, sybil.peer_id, round_=k, version=0,
                                        tasks=2, n=2, params=params, rng=rng,
                                        hidden_size=model.config.hidden_size,
                                        policy_id=trainer_id.peer_id)
                    for k in range(PER_SYBIL)]

        flood = {s.peer_id: flood_batches(s) for s in sybils}
        await async_wait_until(lambda: all(trainer_id.peer_id in n.gossip.topic_peers("rollouts")
                                     for n in [honest_node, *sybils]), 30,
                         "every sender to see the trainer's subscription")

        async def send_flood():
            for k in range(PER_SYBIL):
                for s in sybils:
                    await s.publish("rollouts", flood[s.peer_id][k])

        async def send_honest():
            for i, batch in enumerate(honest):
                await honest_node.publish("rollouts", batch)
                await asyncio.sleep(0)  # interleave with the flood

        await asyncio.gather(send_flood(), send_honest())
        honest_id = honest_node.peer_id

        def honest_done():
            return order.count(honest_id) == HONEST_BATCHES

        loop = asyncio.get_running_loop()
        deadline = loop.time() + 120
        stop = asyncio.Event()
        while not honest_done():  # verify as batches arrive (the intake's arrival event)
            assert loop.time() < deadline, f"honest batches verified: {order.count(honest_id)}"
            await role.intake.wait(stop, deadline - loop.time())
            await role.intake.drain()
        counts = role.state.by_peer[honest_id]
        assert counts.accepted == HONEST_BATCHES * 4 and not counts.rejected
        last_honest = max(i for i, s in enumerate(order) if s == honest_id)
        flood_before = sum(1 for s in order[:last_honest] if s != honest_id)
        # probation share 0.2: at most about one flood batch per four honest ones
        assert flood_before <= 2, order
        assert len(role.intake.queue) <= role.intake.queue.limits.max_probation
        # after the flood (every sybil done sending, what it left still queued): the honest
        # peer is still connected and not refused, and its next batch is verified and
        # accepted, without a restart
        assert honest_id in hub.connected_peers() and not hub.penalties.refused(honest_id)
        await honest_node.publish("rollouts", after)
        await async_wait_until(lambda: role.arrivals.count(honest_id) == HONEST_BATCHES + 1
                               and len(role.arrivals) >= FLOOD_BATCHES + HONEST_BATCHES + 1,
                               30, "the flood and the honest batch after it to arrive")
        await role.intake.drain()  # what is left: every flood batch verified fails ...
        assert counts.accepted == (HONEST_BATCHES + 1) * 4 and not counts.rejected
        flood_ids = {s for s in order if s != honest_id}
        assert flood_ids and all(not role.state.by_peer[s].accepted for s in flood_ids)
        # a sybil's first bogus batch bans its key; its queued rest is never verified
        assert len(order) - HONEST_BATCHES - 1 <= 2 * SYBILS, order
        # ... and the connections that carried them are penalised
        assert all(hub.penalties.score(s) > 0 or hub.penalties.refused(s) for s in flood_ids), \
            [(s[-6:], hub.penalties.score(s), hub.penalties.refused(s)) for s in flood_ids]
    finally:
        if role is not None:
            role.trainer.close()
        for n in (*sybils, honest_node, hub):
            await n.close()
