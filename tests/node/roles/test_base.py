"""What every role shares (node/roles/base.py): a peer's reading of the per-batch verdict
summary a trainer sends (written by verifier/intake.py; its sending and the ban notices are
tested in tests/verifier/test_intake.py), and the tolerant parse of a peer's text. Verdicts
travel through an in-memory loop in place of the gossip topic."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

from swarm_node.node.config import Config
from swarm_node.node.identity import Identity
from swarm_node.node.metrics import NodeState
from swarm_node.node.roles.base import Role
from swarm_node.protocol.messages import Verdict
from swarm_node.verifier.verdicts import SUMMARY_REASON, parse_summary, summary_detail

from .fakes import FakeP2P


class VerdictLoop(FakeP2P):
    """Every verdict published by `sender_id` is handed to the subscribed handlers."""

    def __init__(self):
        super().__init__()
        self.published = []
        self.handlers = []

    async def subscribe(self, topic, handler) -> None:
        self.handlers.append(handler)

    async def publish(self, topic, msg) -> None:
        self.published.append(msg)
        for handler in self.handlers:
            await handler(SimpleNamespace(sender=self.sender_id, message=msg), "conn")


def role(tmp_path, name, p2p) -> Role:
    ident = Identity.generate()
    cfg = Config.model_validate({"node": {"data_dir": str(tmp_path / name)}})
    return Role(cfg, ident, p2p, NodeState(ident.peer_id, name, "s"))


async def test_a_batch_summary_reaches_its_sender_and_no_one_else(tmp_path):
    loop = VerdictLoop()
    trainer, peer, bystander = (role(tmp_path, n, loop) for n in ("trainer", "peer", "other"))
    loop.sender_id = trainer.identity.peer_id
    await peer.watch_verdicts()
    await bystander.watch_verdicts()
    summary = Verdict(rollout_id=b"\x01" * 32, subject=peer.identity.peer_id, accept=True,
                      reason=SUMMARY_REASON, policy_version=3,
                      detail=summary_detail(2, Counter({"token_mismatch": 1}), 7))
    try:
        await loop.publish("verdicts", summary)
    finally:
        for r in (trainer, peer, bystander):
            await r.close()
    mine = peer.state.own_verdicts
    assert mine.accepted == 2 and dict(mine.rejected) == {"token_mismatch": 1}
    assert mine.by_trainer[loop.sender_id]["accepted"] == 2
    assert bystander.state.own_verdicts.accepted == 0
    assert not bystander.state.own_verdicts.rejected


def test_summary_round_trip_and_hostile_text():
    detail = summary_detail(6, Counter({"token_mismatch": 2, "bad_task": 1}), 4)
    assert parse_summary(detail) == {"accepted": 6, "round": "4",
                                     "reasons": {"token_mismatch": 2, "bad_task": 1}}
    hostile = ("accepted=99999999999 round=x reasons=ok:1,bad:zz,:3," + "r" * 80 + ":2 "
               "junk =1")
    assert parse_summary(hostile) == {"accepted": 1 << 20, "round": "?", "reasons": {"ok": 1}}
