"""Out of memory while sampling (issue 14): caught with a hint, the node's role stays up and
retries with half the batch. The model and sampler are real (the tiny model, HFSampler);
the limit is a fake allocator: a hook on the decoder raises torch.OutOfMemoryError when a
forward pass holds more sequences than it allows, as a full GPU would.
"""

from __future__ import annotations

import logging

import pytest
import torch
from swarm_node.node.config import load_config
from swarm_node.node.errors import NodeError
from swarm_node.node.metrics import NodeState
from swarm_node.node.roles.base import Role
from swarm_node.node.sampler.hf import HFSampler
from swarm_node.node.sampler.rounds import sample_round
from swarm_node.node.tasks import TaskSource
from swarm_node.protocol.messages import SamplingParams


def fake_allocator_limit(sampler: HFSampler, max_rows: int) -> list[int]:
    """Raise OutOfMemoryError for forward passes over more than `max_rows` sequences."""
    seen: list[int] = []

    def hook(module, args, kwargs):
        rows = kwargs["input_ids"].shape[0]
        seen.append(rows)
        if rows > max_rows:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate for {rows} rows")
    sampler.decoder.register_forward_pre_hook(hook, with_kwargs=True)
    return seen


@pytest.fixture
def role_and_sampler(tmp_path, tiny_model_dir):
    from swarm_node.node.models import load_model

    cfg = load_config(None, {"node.data_dir": str(tmp_path), "sampler.max_batch": 16})
    model, tok = load_model(tiny_model_dir)
    sampler = HFSampler(model, tok, peer_id="12D3KooWtest", max_batch=cfg.sampler.max_batch)
    role = Role(cfg, None, None, NodeState("12D3KooWtest", "inference", "s"))
    yield role, sampler, tok
    role._pool.shutdown(wait=True)


async def test_oom_is_caught_and_sampling_retries_smaller(role_and_sampler, caplog):
    role, sampler, tok = role_and_sampler
    seen = fake_allocator_limit(sampler, max_rows=4)
    tasks = TaskSource({"toy/digit_successor": 1.0}, "s")
    params = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=2)

    def one_round(round_):
        return sample_round(sampler, tok, tasks, "12D3KooWtest", round_, 4, 4, params)

    with caplog.at_level(logging.WARNING, logger="swarm_node"):
        samples = await role.work_oom_safe(one_round, 0, sampler=sampler)
    assert len(samples) == 16  # the whole round, in batches that fit
    assert sampler.max_batch == 4  # 16 -> 8 -> 4
    assert max(seen[-4:]) <= 4
    assert role.state.counters["out_of_memory"] == 2
    hint = [r.getMessage() for r in caplog.records if "out of memory" in r.getMessage()]
    assert len(hint) == 2 and "--set sampler.max_batch=" in hint[0]
    # the next round starts at the size that fit: no new error
    assert len(await role.work_oom_safe(one_round, 1, sampler=sampler)) == 16
    assert role.state.counters["out_of_memory"] == 2


async def test_oom_at_batch_one_is_one_clear_error(role_and_sampler):
    role, sampler, tok = role_and_sampler
    fake_allocator_limit(sampler, max_rows=0)
    tasks = TaskSource({"toy/digit_successor": 1.0}, "s")
    params = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=2)
    with pytest.raises(NodeError, match="out of memory .* sampler.max_batch = 1.*doctor"):
        await role.work_oom_safe(lambda r: sample_round(sampler, tok, tasks, "12D3KooWtest", r,
                                                        2, 2, params), 0, sampler=sampler)


async def test_other_errors_are_not_swallowed(role_and_sampler):
    role, sampler, _ = role_and_sampler

    def broken(_):
        raise ValueError("not memory")
    with pytest.raises(ValueError, match="not memory"):
        await role.work_oom_safe(broken, 0, sampler=sampler)
    assert sampler.max_batch == 16


async def test_oom_in_a_train_step_retries_smaller_without_losing_groups(tmp_path,
                                                                          tiny_model_dir):
    from swarm_node.node.config import Config
    from swarm_node.node.roles.trainer import TrainerRole
    from swarm_node.node.trainer.trainer import Trainer

    from ..node.trainer.helpers import mixed_group

    cfg = Config.model_validate({
        "node": {"data_dir": str(tmp_path / "data"), "role": "trainer"},
        "model": {"name": str(tiny_model_dir), "device": "cpu"},
        "trainer": {"local_items": 4, "external_items": 0, "micro_batch_size": 16}})
    trainer = Trainer(cfg, tiny_model_dir, cfg.data_dir, policy_id="me")
    role = TrainerRole(cfg, None, None, NodeState("me", "trainer", "s"))
    role.trainer = trainer
    try:
        for i in range(4):
            trainer.add_local(mixed_group(trainer.tokenizer, i, g=4))  # 16 rows in all

        first: list[int] = []

        def limit(module, args, kwargs):
            # The fake allocator: a forward pass over more than ~30% of the tokens of the
            # first (whole-batch) pass does not fit. Rows may be packed, so count tokens.
            ids = kwargs.get("input_ids", args[0] if args else None)
            if not first:
                first.append(ids.numel())
            if ids.numel() > 0.3 * first[0] or ids.numel() == first[0]:
                raise torch.OutOfMemoryError("CUDA out of memory (fake limit)")
        trainer.model.get_decoder().register_forward_pre_hook(limit, with_kwargs=True)
        stats = await role.work_oom_safe(trainer.step, limit=trainer.micro_batch,
                                         on_oom=trainer.undo_failed_step)
        assert stats.trained and stats.version == 1
        assert stats.groups_local == 4  # the groups of the failed attempts were not lost
        assert trainer.micro_batch.value == 4  # 16 -> 8 -> 4
        assert cfg.trainer.micro_batch_size == 16  # runtime state, not the config
        assert role.state.counters["out_of_memory"] == 2
    finally:
        role._pool.shutdown(wait=True)
        trainer.close()
