"""The trainer role's wiring of its intake (verifier/intake.py) against fakes: a scripted
verifier, a fake checkpoint feed, a trainer that records what it is given. What the trainer
may train on is only what the verifier accepted, in the verifier's own terms (decoded text,
recomputed logprobs and reward). The real verifier and trainer behind the same intake are
proven by tests/verifier/test_flood.py, tests/verifier/test_intake.py and
tests/integration."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
from swarm_node.node.config import Config
from swarm_node.node.identity import Identity
from swarm_node.node.metrics import NodeState
from swarm_node.node.roles.trainer import TrainerRole
from swarm_node.protocol.messages import RolloutBatch, SamplingParams
from swarm_node.verifier.checks import RolloutResult, rollout_id
from swarm_node.verifier.reputation import Reputation

from ...protocol.examples import completion
from .fakes import FakeFeed, FakeP2P

FOLLOWED = "12D3KooWtrainerFollowed"
SENDER = "12D3KooWinferencePeer"


class ScriptedVerifier:
    """Accepts the completions whose index is in `accept`, rejects the rest as `reject_as`."""

    def __init__(self, accept: set[int], reject_as: str = "logprob_mismatch"):
        self.accept, self.reject_as = accept, reject_as
        self.calls: list[tuple[str, int]] = []

    def latest_version(self) -> int:
        return 0

    def verify(self, batch, sender, spot_check=None, probe=False,
               as_of=None) -> list[RolloutResult]:
        self.calls.append((batch.policy_id, batch.round))
        out = []
        for i, c in enumerate(batch.completions):
            ok = i in self.accept
            out.append(RolloutResult(
                i, rollout_id(batch, c), ok, "ok" if ok else self.reject_as,
                reward=0.25 if ok else None, text=f"verified-{i}" if ok else None,
                logprobs=np.full(c.completion_ids.shape[0], -2.0, np.float32) if ok else None))
        return out


class RecordingTrainer:
    def __init__(self):
        self.version = 0
        self.external: list[RolloutBatch] = []

    def add_external(self, batch: RolloutBatch, sender: str = "", as_of=None) -> None:
        self.external.append(batch)

    def drop_sender(self, sender: str) -> int:
        return 0

    def close(self) -> None:
        pass


def batch(policy_id: str, n: int = 2, round_: int = 0) -> RolloutBatch:
    return RolloutBatch(swarm_id="unit", round=round_, policy_id=policy_id, policy_version=0,
                        sampling=SamplingParams(),
                        completions=[completion(3, seed=s) for s in range(n)])


def new_role(tmp_path, verifier, follow=()):
    cfg = Config.model_validate({"node": {"data_dir": str(tmp_path), "role": "trainer",
                                          "swarm_id": "unit"}})
    ident = Identity.generate()
    feed = FakeFeed(tmp_path, follow=follow)
    role = TrainerRole(cfg, ident, FakeP2P(), NodeState(ident.peer_id, "trainer", "unit"),
                       feed=feed, verifier_for=lambda policy_id: verifier)
    role.trainer = RecordingTrainer()
    role.intake = role.build_intake(Reputation(None))
    return role, feed


async def receive(role, b: RolloutBatch, sender: str = SENDER) -> None:
    await role.intake.offer(SimpleNamespace(sender=sender, message=b), "conn-peer")
    await role.intake.drain()


async def test_only_what_the_verifier_accepted_reaches_the_trainer_in_its_terms(tmp_path):
    verifier = ScriptedVerifier(accept={0})
    role, _feed = new_role(tmp_path, verifier)
    try:
        await receive(role, batch(role.identity.peer_id))  # this trainer's own policy
    finally:
        await role.close()
    [got] = role.trainer.external
    [c] = got.completions
    assert c.text == "verified-0" and c.claimed_reward == 0.25  # the verifier's, not claimed
    assert np.all(c.logprobs.to_numpy() == -2.0)
    peer = role.state.by_peer[SENDER]
    assert (peer.accepted, peer.rejected, dict(peer.reasons)) == (1, 1,
                                                                  {"logprob_mismatch": 1})
    verdicts = [m for topic, m in role.p2p.published if topic == "verdicts"]
    assert [(v.subject, v.reason) for v in verdicts] == [(SENDER, "logprob_mismatch"),
                                                        (SENDER, "batch_summary")]


async def test_another_trainers_policy_is_verified_only_when_followed(tmp_path):
    verifier = ScriptedVerifier(accept={0, 1})
    role, feed = new_role(tmp_path, verifier)
    try:
        await receive(role, batch(FOLLOWED, round_=0))
        assert verifier.calls == [] and role.trainer.external == []
        assert role.state.by_peer[SENDER].reasons["unknown_policy"] == 2
        feed.followed.add(FOLLOWED)  # now following it (its checkpoints are verified here)
        await receive(role, batch(FOLLOWED, round_=1))
    finally:
        await role.close()
    assert verifier.calls == [(FOLLOWED, 1)]
    assert [len(b.completions) for b in role.trainer.external] == [2]


async def test_a_banned_sender_is_not_queued_nor_verified(tmp_path):
    verifier = ScriptedVerifier(accept={0, 1})
    role, _feed = new_role(tmp_path, verifier)
    try:
        while not role.intake.reputation.is_banned(SENDER):
            role.intake.reputation.record(SENDER, False, "token_mismatch")
        await receive(role, batch(role.identity.peer_id))
    finally:
        await role.close()
    assert len(role.intake.queue) == 0 and verifier.calls == [] and role.trainer.external == []
    assert role.state.by_peer[SENDER].reasons["banned"] == 2


async def test_followed_checkpoints_and_versions_come_from_the_feed(tmp_path):
    role, feed = new_role(tmp_path, ScriptedVerifier(accept=set()), follow=[FOLLOWED])
    try:
        assert role._checkpoint_path(FOLLOWED, 3) is None
        assert role._latest_for(FOLLOWED)() == -1
        feed.deliver(FOLLOWED, 3, tmp_path / "v3")
        assert role._checkpoint_path(FOLLOWED, 3) == tmp_path / "v3"
        assert role._latest_for(FOLLOWED)() == 3
    finally:
        await role.close()
