"""The demo's pieces that need no processes: the real-model config and the summary.

The whole demo runs as real processes in tests/integration (tiny model)."""

from __future__ import annotations

from pathlib import Path

from swarm_node.node import demo
from swarm_node.node.config import Config
from swarm_node.node.roles.settings import swarm_settings
from swarm_node.node.tasks import SMALL_ARITHMETIC, PromptStyle, TaskSource, get_task


def test_smollm2_config_draws_small_arithmetic_in_the_answer_format():
    node = demo.DemoNode("trainer", "trainer", Path("/tmp/unused"))
    raw = demo.smollm2_settings(demo.node_config(node, Path("/m"), [], [], "demo"))
    cfg = Config.model_validate(raw)
    ref = TaskSource.of(cfg.tasks, "demo").draw("peer", 0, 1)[0]
    assert ref.params == SMALL_ARITHMETIC
    task = get_task(ref, cfg.tasks.format_reward, PromptStyle.of(cfg.tasks))
    assert len(task.examples) == 2 and "<answer>" in task.system
    assert task.score(task.reference_completion) == 1.0 and cfg.tasks.format_reward == 0.0
    settings = swarm_settings(cfg)  # what the trainer announces to the peers
    assert (settings.system_prompt, settings.few_shot) == ("direct", 2)
    assert settings.task_params == {demo.SMOLLM2_TASK: SMALL_ARITHMETIC}


def _node(name, role, peer, dishonest="none"):
    node = demo.DemoNode(name, role, Path("/tmp/unused"), dishonest=dishonest)
    node.info = {"peer_id": peer}
    return node


def test_summary_without_a_cheater_judges_learning_alone():
    trainer = _node("trainer", "trainer", "T")
    trainer.last_status = {"policy_version": 4, "banned": [],
                           "reward_history": [[1, 0.1], [2, 0.2], [3, 0.3], [4, 0.5]],
                           "accepted_by_peer": {"A": {"accepted": 16, "rejected": 0}}}
    nodes = [trainer, _node("relay", "relay", "R"), _node("inference-1", "inference", "A")]
    text, ok = demo.summary(nodes)
    assert ok and "dishonest" not in text and "reward rose: yes" in text
    # with a cheater that was never banned, the same swarm fails the demo
    text, ok = demo.summary([*nodes, _node("cheater", "inference", "C", "tamper_tokens")])
    assert not ok and "dishonest peer: not banned" in text
