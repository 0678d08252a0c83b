"""The trainer role samples its own round only while the next step has room for it: peers'
verified groups of its policy go first (node/trainer/trainer.py), so own samples beyond the
I local slots would only wait and go stale. A real TrainerRole over a real Trainer (tiny
model); only the p2p host is a fake."""

from __future__ import annotations

from swarm_node.node.config import Config
from swarm_node.node.identity import Identity
from swarm_node.node.metrics import NodeState

from ..trainer.helpers import mixed_group
from ..trainer.test_trainer import own_batch
from .fakes import FakeP2P


async def test_own_round_only_while_the_next_step_has_room(tmp_path, tiny_model_dir):
    from swarm_node.node.roles.trainer import TrainerRole
    from swarm_node.node.trainer.trainer import Trainer

    cfg = Config.model_validate({
        "node": {"data_dir": str(tmp_path / "t"), "role": "trainer", "swarm_id": "unit"},
        "model": {"device": "cpu"},
        "trainer": {"local_items": 2, "external_items": 0, "max_staleness": 1}})
    ident = Identity.generate()
    role = TrainerRole(cfg, ident, FakeP2P(), NodeState(ident.peer_id, "trainer", "unit"))
    role.trainer = t = await role.work(Trainer, cfg, tiny_model_dir, role.data_dir,
                                       policy_id="me")
    try:
        tok = t.tokenizer
        assert t.local_room() == 2 and await role._own_round_wanted()
        # one peer group waiting: room for one more, so it samples
        assert t.add_external(own_batch(tok, 1), "peer", as_of=0) == 1
        assert t.local_room() == 1 and await role._own_round_wanted()
        # an own group and a second peer's: the step is full, no own round (counted); the
        # step takes the peers' groups, the own one waits
        assert t.add_local(mixed_group(tok, 2)) == 1
        assert t.add_external(own_batch(tok, 3), "peer", as_of=0) == 1
        assert t.local_room() == 0 and not await role._own_round_wanted()
        assert role.state.counters["sampling_rounds_skipped"] == 1
        s = await role.work(t.step)
        assert s.groups_local == 2
        assert [g.sender for g in t.buffer.pending("local")] == [""]
        assert t.local_room() == 1 and await role._own_round_wanted()
        # a waiting group past max_staleness leaves room: it will be dropped, not trained
        t.version += 1
        assert t.local_room() == 2
        assert role.state.counters["sampling_rounds_skipped"] == 1
    finally:
        t.close()
