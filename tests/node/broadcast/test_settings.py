"""Swarm settings travel with the policy (issue 14): adopted when not set here, refused
with one line naming the difference when set differently."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from swarm_node.node.config import Config, load_config
from swarm_node.node.roles.settings import SettingsFollower, swarm_settings

from tests.launch import start_demo_node
from tests.waiting import async_wait_until

from .conftest import publish


def trainer_settings(**tasks):
    cfg = load_config(None, {"model.name": "builtin:smollm2-135m",
                             "tasks.mix": {"toy/digit_successor": 1.0},
                             "sampler.max_new_tokens": 2,
                             **{f"tasks.{k}": v for k, v in tasks.items()}})
    return swarm_settings(cfg)


def test_defaults_are_adopted_into_the_checkpoints_settings_not_the_config():
    cfg = Config()
    f = SettingsFollower(cfg)
    assert f.check(trainer_settings(tasks_per_round=8), "T", 1) is None
    eff = f.effective_for("T", 1)
    assert eff.config.sampler.max_new_tokens == 2 and eff.config.tasks.tasks_per_round == 8
    assert eff.model_id == "builtin:smollm2-135m" and f.adopted["model_id"] == eff.model_id
    assert eff.config.model.name == "builtin:tiny"  # the model comes from the checkpoint itself
    assert cfg == Config()  # the node's config is untouched
    # a version not checked in this run (found on disk): the trainer's newest accepted
    assert f.effective_for("T", 7) is eff and f.effective_for("other", 1) is f.local
    assert f.check(trainer_settings(tasks_per_round=8), "T", 2) is None  # stable
    assert f.effective_for("T", 2) == eff
    # a trainer going back to this node's values: nothing adopted for that version
    back = swarm_settings(Config().with_overrides({"model.name": "builtin:tiny"}))
    assert f.check(back, "T", 3) is None and not f.effective_for("T", 3).adopted


def test_explicit_differences_are_refused_naming_each(caplog):
    cfg = load_config(None, {"sampler.max_new_tokens": 5,  # set by the operator
                             "tasks.mix": {"toy/digit_successor": 1.0}})
    f = SettingsFollower(cfg)
    for _ in range(3):
        line = f.check(trainer_settings(), "trainer-key", 1)
    assert "sampler.max_new_tokens = 5 here, 2 in the swarm" in line
    assert "tasks.mix" not in line  # equal values are not differences
    assert f.refused == line and f.effective_for("trainer-key", 1) is f.local
    assert [r.message for r in caplog.records].count(line) == 1  # one line, not one per try


def test_other_protocol_version_unknown_tasks_and_values_out_of_range_are_refused():
    s = trainer_settings()
    f = SettingsFollower(Config())
    assert "protocol version 99" in f.check(s.model_copy(update={"protocol_version": 99}))
    line = SettingsFollower(Config()).check(
        s.model_copy(update={"task_mix": {"no/such_task": 1.0}}))
    assert line and "no/such_task" in line
    line = SettingsFollower(Config()).check(s.model_copy(update={"tasks_per_round": 999}))
    assert line and "tasks.tasks_per_round" in line


def test_prompt_style_travels_with_the_policy():
    """Every peer and verifier must build the same prompts: the trainer's tasks.system_prompt
    and tasks.few_shot are adopted, refused when set differently here or unusable here."""
    f = SettingsFollower(Config())
    assert f.check(trainer_settings(system_prompt="direct"), "T", 1) is None
    assert f.effective_for("T", 1).config.tasks.system_prompt == "direct"
    mine = load_config(None, {"tasks.system_prompt": "simple"})  # set by the operator
    line = SettingsFollower(mine).check(trainer_settings(system_prompt="direct"), "T")
    assert "tasks.system_prompt = 'simple' here, 'direct' in the swarm" in line
    odd = trainer_settings().model_copy(update={"system_prompt": "no-such-prompt"})
    assert "no-such-prompt" in SettingsFollower(Config()).check(odd, "T")
    f = SettingsFollower(Config())
    assert f.check(trainer_settings(few_shot=2), "T", 1) is None
    assert f.effective_for("T", 1).config.tasks.few_shot == 2
    many = trainer_settings().model_copy(update={"few_shot": 9})
    assert "tasks.few_shot 9" in SettingsFollower(Config()).check(many, "T")


def test_generator_params_travel_with_the_policy():
    params = {"rg/basic_arithmetic": {"max_digits": 1}}
    f = SettingsFollower(Config())
    s = trainer_settings(mix={"rg/basic_arithmetic": 1.0}, params=params)
    assert s.task_params == params
    assert f.check(s, "T", 1) is None
    tasks = f.effective_for("T", 1).config.tasks
    assert tasks.params == params and tasks.mix == {"rg/basic_arithmetic": 1.0}
    # params of a dataset that is not in the mix cannot be drawn: refused, naming them
    odd = trainer_settings().model_copy(update={"task_params": params})
    assert "rg/basic_arithmetic" in SettingsFollower(Config()).check(odd, "T")


def test_gate_refuses_a_policy_with_conflicting_settings(ckpt, trainer):
    from swarm_node.node.broadcast.errors import ManifestRejected
    from swarm_node.node.broadcast.manifest import ManifestGate, build_manifest
    from swarm_node.node.config import BroadcastSection

    cfg = load_config(None, {"sampler.temperature": 0.3})
    gate = ManifestGate.from_config([trainer.peer_id], BroadcastSection(min_shard_size=4096),
                                    lambda p: -1, settings_check=SettingsFollower(cfg).check)
    m = build_manifest(ckpt, policy_id=trainer.peer_id, version=1, shard_size=64 * 1024,
                       settings=trainer_settings())
    with pytest.raises(ManifestRejected) as e:
        gate.check_bytes(trainer.seal(m))
    assert e.value.reason == "settings_mismatch" and "sampler.temperature" in str(e.value)
    # a manifest without settings (an older trainer) is judged on the rest alone
    assert gate.check_bytes(publish(trainer, ckpt, 1, 64 * 1024).envelope)


@pytest.mark.slow
async def test_inference_peer_with_only_bootstrap_adopts_and_contributes(tmp_path):
    """Real `swarm-node join` processes: a trainer with the demo's settings, one inference
    peer given only --bootstrap (adopts them, model included, and its rollouts are
    accepted), one with a conflicting explicit setting (refuses with one line)."""
    from swarm_node.node import demo
    from swarm_node.node.models import build_tiny_model

    DemoNode, fetch_status, wait_info = demo.DemoNode, demo.fetch_status, demo.wait_info
    node_config, stop_nodes = demo.node_config, demo.stop_nodes
    start_node = start_demo_node  # demo.start_node, forked warm

    model_dir = tmp_path / "model"
    build_tiny_model(model_dir, seed=0)
    trainer = DemoNode("trainer", "trainer", tmp_path / "trainer")
    cfg = node_config(trainer, model_dir, [], [], "default")
    # The trainer steps every 3 s on what arrived, verifying batches meanwhile: paced per
    # peer batch, each step a new version that the adopter downloads and checks again, the
    # three processes ran flat out. The adopter samples the trainer's v0 (its base model) with
    # the adopted settings too: none of its rounds is rejected.
    cfg["trainer"] |= {"peer_batches_per_step": 1000, "peer_wait_s": 3.0}
    start_node(trainer, cfg)
    nodes = [trainer]
    try:
        info = wait_info(trainer)
        boot = [info["listen_addrs"][0]]

        def bare(name: str, **extra) -> DemoNode:
            node = DemoNode(name, "inference", tmp_path / name)
            conf = {"node": {"role": "inference", "data_dir": str(node.dir / "data"),
                             "listen": ["/ip4/127.0.0.1/tcp/0"], "bootstrap": boot},
                    "admin": {"port": 0}, **extra}
            start_node(node, conf)
            nodes.append(node)
            return node
        adopter = bare("adopter")
        refuser = bare("refuser", sampler={"max_new_tokens": 5})
        for node in nodes[1:]:
            wait_info(node)
        async def adopted_and_refused():  # three processes' /status, read in a thread
            t, a, r = await asyncio.to_thread(
                lambda: [fetch_status(n) for n in (trainer, adopter, refuser)])
            accepted = t.get("accepted_by_peer", {}).get(a.get("peer_id", "?"), {})
            refused = r.get("extra", {}).get("settings", {}).get("refused")
            return (a, r) if accepted.get("accepted", 0) > 0 and refused else None

        a, r = await async_wait_until(
            adopted_and_refused, 240, "an adoption and a refusal", interval=0.25,
            details=lambda: f"trainer {trainer.last_status}, adopter {adopter.last_status}, "
                            f"refuser {refuser.last_status}")
        adopted = a["extra"]["settings"]["adopted"]
        refused = r["extra"]["settings"]["refused"]
        assert adopted["tasks_per_round"] == 8  # the demo trainer's, default here 4
        assert adopted["max_new_tokens"] == 2 and adopted["model_id"] == str(model_dir)
        assert "sampler.max_new_tokens = 5 here, 2 in the swarm" in refused
        assert r.get("rollouts_sent", 0) == 0
        rejected = fetch_status(trainer).get("accepted_by_peer", {})[a["peer_id"]]["rejected"]
        assert not rejected, rejected  # a v0 sampled unadopted was rejected: sampling_params
        log = Path(refuser.log_path).read_text()
        assert log.count("refusing the policy of trainer") == 1
    finally:
        stop_nodes(nodes)
