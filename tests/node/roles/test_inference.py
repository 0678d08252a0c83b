"""The inference role against in-memory fakes (tests/node/roles/fakes.py) and the real tiny
model: which checkpoints it loads, what it publishes, that it stops. The real broadcaster
and gossip are proven by tests/integration/test_swarm.py."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest
import torch
from swarm_node.node.config import Config
from swarm_node.node.identity import Identity
from swarm_node.node.metrics import NodeState
from swarm_node.node.models import build_tiny_model
from swarm_node.node.roles.inference import InferenceRole
from swarm_node.node.roles.interfaces import DownloadStatus
from swarm_node.node.sampler.hf import read_state_dict

from tests.waiting import async_wait_until

from .fakes import FakeFeed, FakeP2P, RecordingSink

TRAINER = "12D3KooWtrainerFollowed"
OTHER = "12D3KooWtrainerNotFollowed"
HANG_GUARD_S = 60  # a bound against a hang, not a timing assertion


def make_cfg(model_dir, data_dir, follow=(TRAINER,)) -> Config:
    data_dir.mkdir(parents=True, exist_ok=True)  # the runner's job in the node
    return Config.model_validate({
        "node": {"data_dir": str(data_dir), "role": "inference", "follow": list(follow),
                 "swarm_id": "unit"},
        "model": {"name": str(model_dir), "device": "cpu"},
        "tasks": {"tasks_per_round": 1},
        "sampler": {"backend": "hf", "completions_per_task": 2, "max_new_tokens": 4,
                    "batches_per_version": 2}})


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Two tiny-model checkpoints with weights unlike the seed-0 base (and each other)."""
    root = tmp_path_factory.mktemp("ckpts")
    return {v: build_tiny_model(root / f"v{v}", seed=v) for v in (1, 2)}


async def started_role(cfg, feed, sink) -> InferenceRole:
    ident = Identity.generate()
    role = InferenceRole(cfg, ident, FakeP2P(), NodeState(ident.peer_id, "inference", "unit"),
                         feed=feed, sink=sink)
    await role.start()
    return role


def same_weights(model, ckpt_dir) -> bool:
    state = read_state_dict(ckpt_dir)
    params = dict(model.named_parameters())
    return all(torch.equal(params[k].detach(), t) for k, t in state.items() if k in params)


async def test_hot_loads_each_newer_followed_version_and_binds_batches_to_it(
        tmp_path, tiny_model_dir, checkpoints):
    feed = FakeFeed(tmp_path, follow=[TRAINER], chosen=TRAINER)
    stop = asyncio.Event()

    def after_publish(batch, n):
        if n == 1:  # while v1's rounds are being used: a newer version, and decoys
            feed.deliver(OTHER, 9, checkpoints[1])  # another trainer's: never loaded
            feed.deliver(TRAINER, 2, checkpoints[2])
            feed.deliver(TRAINER, 1, checkpoints[1])  # older than pending: ignored
        else:
            stop.set()

    sink = RecordingSink(after_publish)
    role = await started_role(make_cfg(tiny_model_dir, tmp_path / "data"), feed, sink)
    try:
        assert feed.started and role.sampler.version == 0
        feed.deliver(TRAINER, 1, checkpoints[1])
        await asyncio.wait_for(role.run(stop), HANG_GUARD_S)
    finally:
        await role.close()

    got = [(b.policy_id, b.policy_version, b.round) for b in sink.batches]
    # v1's first round (window [2, 4)), then v2's first round (window [4, 6))
    assert got == [(TRAINER, 1, 2), (TRAINER, 2, 4)]
    assert all(b.swarm_id == "unit" and len(b.completions) == 2 for b in sink.batches)
    assert role.sampler.version == 2 and role.state.policy_version == 2
    assert same_weights(role.sampler.model, checkpoints[2])
    assert json.loads((tmp_path / "data" / "round.json").read_text()) == {"next_round": 5}
    assert role.state.rollouts_sent == 4 and feed.closed


async def test_never_loads_a_checkpoint_of_a_policy_it_does_not_follow(
        tmp_path, tiny_model_dir, checkpoints):
    feed = FakeFeed(tmp_path, follow=[TRAINER], chosen=TRAINER)
    role = await started_role(make_cfg(tiny_model_dir, tmp_path / "data"), feed,
                              RecordingSink())
    try:
        feed.deliver(OTHER, 5, checkpoints[1])
        assert role.pending is None and not role.new_version.is_set()
        await role._maybe_reload()
        assert role.sampler.version == 0
        assert not same_weights(role.sampler.model, checkpoints[1])
    finally:
        await role.close()


async def test_a_trainer_chosen_after_start_is_followed_from_then_on(
        tmp_path, tiny_model_dir, checkpoints):
    feed = FakeFeed(tmp_path)  # no --follow, nothing announced yet
    role = await started_role(make_cfg(tiny_model_dir, tmp_path / "data", follow=()), feed,
                              RecordingSink())
    try:
        assert role.policy_id is None
        feed.choose(TRAINER)  # the bootstrap peer announced its trainer
        feed.deliver(TRAINER, 1, checkpoints[1])
        assert role.policy_id == TRAINER and role.pending == (1, checkpoints[1])
        await role._maybe_reload()
        assert role.sampler.version == 1 and same_weights(role.sampler.model, checkpoints[1])
    finally:
        await role.close()


async def first_round_on_v0(cfg, tmp_path, model_dir, before_run=lambda role: None):
    """A role waiting for its first version is handed the trainer's v0 (`model_dir`, the
    base model it holds) and runs until its first batch: (the closed role, its batches)."""
    feed, stop = FakeFeed(tmp_path, follow=[TRAINER], chosen=TRAINER), asyncio.Event()
    sink = RecordingSink(lambda batch, n: stop.set())
    role = await started_role(cfg, feed, sink)
    try:
        before_run(role)
        run = asyncio.create_task(role.run(stop))
        await async_wait_until(lambda: stop._waiters, HANG_GUARD_S,
                               "the role to wait for the trainer's version")
        feed.deliver(TRAINER, 0, model_dir)
        await asyncio.wait_for(run, HANG_GUARD_S)
    finally:
        await role.close()
    return role, sink.batches


async def test_a_trainer_at_the_version_held_here_ends_the_first_wait_at_once(
        tmp_path, tiny_model_dir):
    """A peer started beside a new trainer: the trainer's v0 (the base model held here) is
    its current version, so its arrival ends the first round's wait for the announcement.
    The peer used to wait out sampler.version_wait_s (here 10x the hang guard) first."""
    cfg = make_cfg(tiny_model_dir, tmp_path / "data").with_overrides(
        {"sampler.version_wait_s": 10 * HANG_GUARD_S})
    role, batches = await first_round_on_v0(cfg, tmp_path, tiny_model_dir)
    assert [(b.policy_id, b.policy_version) for b in batches] == [(TRAINER, 0)]
    assert role.sampler.version == 0 and role.pending is None


async def test_stops_on_stop_while_waiting_for_a_version(tmp_path, tiny_model_dir):
    feed, sink = FakeFeed(tmp_path, follow=[TRAINER], chosen=TRAINER), RecordingSink()
    role = await started_role(make_cfg(tiny_model_dir, tmp_path / "data"), feed, sink)
    stop = asyncio.Event()
    try:
        run = asyncio.create_task(role.run(stop))
        await async_wait_until(lambda: stop._waiters, HANG_GUARD_S,
                               "the role to wait for a version or the stop")
        assert not run.done()
        stop.set()
        await asyncio.wait_for(run, HANG_GUARD_S)
    finally:
        await role.close()
    assert sink.batches == [] and role.sampler.version == 0


async def test_a_failed_publish_is_counted_and_the_next_round_goes_out(
        tmp_path, tiny_model_dir, checkpoints):
    feed = FakeFeed(tmp_path, follow=[TRAINER], chosen=TRAINER)
    stop = asyncio.Event()
    sink = RecordingSink(lambda batch, n: stop.set(), fail=1)
    role = await started_role(make_cfg(tiny_model_dir, tmp_path / "data"), feed, sink)
    try:
        feed.deliver(TRAINER, 1, checkpoints[1])
        await asyncio.wait_for(role.run(stop), HANG_GUARD_S)
    finally:
        await role.close()
    # round 2 was lost to the failure (never reused: a verifier would call it a replay)
    assert [(b.policy_version, b.round) for b in sink.batches] == [(1, 3)]
    assert role.state.counters["publish_failed"] == 1


async def test_a_batch_made_stale_by_a_much_newer_version_is_not_sent(
        tmp_path, tiny_model_dir, checkpoints):
    cfg = make_cfg(tiny_model_dir, tmp_path / "data").with_overrides(
        {"trainer.max_staleness": 1})
    feed = FakeFeed(tmp_path, follow=[TRAINER], chosen=TRAINER)
    stop = asyncio.Event()
    sink = RecordingSink(lambda batch, n: stop.set())
    role = await started_role(cfg, feed, sink)
    sample = role.work_oom_safe

    async def v3_arrives_while_sampling(fn, *args, **kwargs):
        batch = await sample(fn, *args, **kwargs)
        if batch.policy_version == 1:
            feed.deliver(TRAINER, 3, checkpoints[2])  # 3 - 1 > max_staleness
        return batch

    role.work_oom_safe = v3_arrives_while_sampling
    try:
        feed.deliver(TRAINER, 1, checkpoints[1])
        await asyncio.wait_for(role.run(stop), HANG_GUARD_S)
    finally:
        await role.close()
    assert role.state.counters["stale_batches_discarded"] == 1
    # v1's round 2 was dropped (and stays used); the next batch is v3's first round
    assert [(b.policy_version, b.round) for b in sink.batches] == [(3, 6)]


async def until(pred, what: str):
    await async_wait_until(pred, HANG_GUARD_S, what)


async def test_a_followed_trainer_that_never_appears_is_named_once_in_log_and_status(
        tmp_path, tiny_model_dir, caplog):
    feed = FakeFeed(tmp_path, follow=[TRAINER], chosen=TRAINER)
    ident = Identity.generate()
    role = InferenceRole(make_cfg(tiny_model_dir, tmp_path / "data"), ident, FakeP2P(),
                         NodeState(ident.peer_id, "inference", "unit"), feed=feed,
                         sink=RecordingSink())
    role.follow_wait_s = 0.2
    try:
        with caplog.at_level(logging.INFO, logger="swarm_node"):
            await role.start()
            await until(lambda: "follow" in role.state.extra, "the follow problem in /status")
            follow = dict(role.state.extra["follow"])
            # it appears later: a download of its checkpoint in flight is enough
            feed.start_download(DownloadStatus(TRAINER, 1, 0, 4, 0, 4096))
            await until(lambda: role.state.extra["follow"]["seen"], "the trainer seen")
    finally:
        await role.close()
    assert follow["trainer"] == TRAINER and follow["seen"] is False
    assert TRAINER in follow["problem"] and "peer id" in follow["problem"]
    told = [r for r in caplog.records if r.levelno == logging.WARNING
            and "followed trainer" in r.getMessage()]
    assert [r.getMessage() for r in told] == [follow["problem"]]  # once, one line
    assert "\n" not in follow["problem"]
    assert any("appeared" in r.getMessage() for r in caplog.records)


async def test_a_round_samples_with_the_settings_of_its_checkpoint(
        tmp_path, tiny_model_dir, checkpoints):
    """The trainer's settings for v1 (accepted by the manifest gate: `settings.check`) apply
    from the round that samples v1 on, as one snapshot; the node's config never changes."""
    from swarm_node.node.roles.settings import swarm_settings

    feed = FakeFeed(tmp_path, follow=[TRAINER], chosen=TRAINER)
    stop = asyncio.Event()
    sink = RecordingSink(lambda batch, n: stop.set())
    cfg = make_cfg(tiny_model_dir, tmp_path / "data")
    role = await started_role(cfg, feed, sink)
    theirs = swarm_settings(cfg.with_overrides({"sampler.temperature": 0.5,
                                                "sampler.top_k": 5}))  # defaults here
    try:
        assert role.settings.check(theirs, TRAINER, 1) is None
        feed.deliver(TRAINER, 1, checkpoints[1])
        await asyncio.wait_for(role.run(stop), HANG_GUARD_S)
    finally:
        await role.close()
    batch = sink.batches[0]
    assert batch.policy_version == 1
    assert (batch.sampling.temperature, batch.sampling.top_k) == (0.5, 5)
    assert dict(role.effective.adopted) == {"temperature": 0.5, "top_k": 5}
    assert role.cfg == make_cfg(tiny_model_dir, tmp_path / "data")  # untouched


async def test_the_trainers_v0_is_sampled_with_its_adopted_settings(tmp_path, tiny_model_dir):
    """A peer started beside a new trainer holds the trainer's v0 (the base model) already;
    when v0's manifest carried settings adopted here, the first round samples with them. It
    used to sample v0 with this node's own settings, and the trainer rejected every such round
    (`sampling_params`)."""
    from swarm_node.node.roles.settings import swarm_settings

    cfg = make_cfg(tiny_model_dir, tmp_path / "data")
    theirs = swarm_settings(cfg.with_overrides({"sampler.temperature": 0.5,
                                                "sampler.top_k": 5}))

    def gate_accepts(role):  # the manifest gate's check of v0
        assert role.settings.check(theirs, TRAINER, 0) is None

    role, batches = await first_round_on_v0(cfg, tmp_path, tiny_model_dir, gate_accepts)
    batch = batches[0]
    assert (batch.policy_id, batch.policy_version) == (TRAINER, 0)
    assert (batch.sampling.temperature, batch.sampling.top_k) == (0.5, 5)
    assert dict(role.effective.adopted) == {"temperature": 0.5, "top_k": 5}


def refusing_cfg(model_dir, data_dir) -> Config:
    """A peer whose explicit temperature differs from the trainer's (its policy is refused
    here), with a staleness bound of 1 and a version wait far beyond the hang guard: only
    a wake ends that wait within the test."""
    return make_cfg(model_dir, data_dir).with_overrides({
        "sampler.temperature": 0.7, "trainer.max_staleness": 1,
        "sampler.version_wait_s": 10 * HANG_GUARD_S})


def trainer_settings(cfg, temperature: float):
    from swarm_node.node.roles.settings import swarm_settings

    return swarm_settings(cfg.with_overrides({"sampler.temperature": temperature}))


async def test_a_refusal_that_makes_rounds_stale_holds_sampling_at_once(
        tmp_path, tiny_model_dir):
    """The manifest gate refuses the followed trainer's policy. Its v1 is within the peer's
    staleness bound (a v0 round is still accepted): nothing wakes the wait for the trainer's
    version. Its v3 is not: sampling is held at once, not when the version wait runs out (it
    used to: the hold took effect at the next round, up to version_wait_s later). A later
    acceptance releases the hold at once too, and the next round goes out."""
    cfg = refusing_cfg(tiny_model_dir, tmp_path / "data")
    feed, stop = FakeFeed(tmp_path, follow=[TRAINER], chosen=TRAINER), asyncio.Event()
    sink = RecordingSink(lambda batch, n: stop.set())
    role = await started_role(cfg, feed, sink)
    theirs = trainer_settings(cfg, 0.5)
    try:
        run = asyncio.create_task(role.run(stop))
        await until(lambda: stop._waiters, "the role to wait for the trainer's version")
        assert role.check_settings(theirs, TRAINER, 1) is not None  # refused, within bound
        assert not role.new_version.is_set() and "sampling_held" not in role.state.extra
        assert role.check_settings(theirs, TRAINER, 3) is not None  # 3 - 0 > 1: stale
        await until(lambda: "sampling_held" in role.state.extra, "sampling held")
        assert "v3 is refused" in role.state.extra["sampling_held"] and sink.batches == []
        # the trainer's settings now match this node's (its next manifest is accepted)
        assert role.check_settings(trainer_settings(cfg, 0.7), TRAINER, 1) is None
        await asyncio.wait_for(run, HANG_GUARD_S)
    finally:
        await role.close()
    assert [(b.policy_id, b.policy_version) for b in sink.batches] == [(TRAINER, 0)]
    assert "sampling_held" not in role.state.extra


async def test_a_hold_that_comes_while_a_round_samples_drops_that_round(
        tmp_path, tiny_model_dir):
    """Sampling is held (a refused v3, more than max_staleness past v0) while a round of
    v0 samples: that round is stale at the trainer and is not sent. It used to be."""
    cfg = refusing_cfg(tiny_model_dir, tmp_path / "data")
    feed = FakeFeed(tmp_path, follow=[TRAINER], chosen=TRAINER)
    sink, stop = RecordingSink(), asyncio.Event()
    role = await started_role(cfg, feed, sink)
    sample = role.work_oom_safe

    async def refused_while_sampling(fn, *args, **kwargs):
        batch = await sample(fn, *args, **kwargs)
        assert role.check_settings(trainer_settings(cfg, 0.5), TRAINER, 3) is not None
        return batch

    role.work_oom_safe = refused_while_sampling
    try:
        feed.deliver(TRAINER, 0, tiny_model_dir)  # ends the first wait: v0 is current
        run = asyncio.create_task(role.run(stop))
        await until(lambda: "sampling_held" in role.state.extra, "sampling held")
        stop.set()
        await asyncio.wait_for(run, HANG_GUARD_S)
    finally:
        await role.close()
    assert sink.batches == [] and role.state.rollouts_sent == 0
    assert role.state.counters["stale_batches_discarded"] == 1
