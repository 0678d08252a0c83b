"""The demo's pieces that need no processes: the real-model config and the summary.

The whole demo runs as real processes in tests/integration (tiny model)."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
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


def test_waiting_for_names_what_the_first_minute_waits_for():
    trainer = _node("trainer", "trainer", "T")
    peers = [_node("inference-1", "inference", "A"), _node("inference-2", "inference", "B")]
    nodes = [trainer, _node("relay", "relay", "R"), *peers]
    assert "trainer to load" in demo.waiting_for(nodes)
    trainer.last_status = {"phase": "running", "reward": None}
    peers[0].last_status = {"phase": "running", "policy_id": "T"}
    assert demo.waiting_for(nodes) == "waiting for inference-2 to load the model"
    peers[1].last_status = {"phase": "running"}
    assert "inference-2 to download the trainer's v0" in demo.waiting_for(nodes)
    peers[1].last_status = {"phase": "running", "policy_id": "T", "rollouts_sent": 16}
    assert "verifies the first rollouts" in demo.waiting_for(nodes)
    trainer.last_status["rollouts_accepted"] = 16
    assert demo.waiting_for(nodes) == "waiting for the first training step"
    trainer.last_status["reward"] = 0.01
    assert demo.waiting_for(nodes) == ""
    assert "reward 0.010" in demo.progress_line(nodes, 50.0)


def test_the_cheaters_numbers_add_up_in_the_summary():
    cheater = _node("cheater", "inference", "C", "tamper_tokens")
    cheater.last_status = {"rollouts_sent": 2432}
    lines = demo.cheater_story(cheater, {"accepted": 0, "rejected": 128, "reasons": {
        "proof_index_mismatch": 63, "proof_length": 1, "banned": 64}}, banned=True)
    text = "\n".join(lines)
    assert "sent 2432" in text and "verified 64: 0 accepted, 64 rejected" in text
    assert "64 more arrived and were refused unverified" in text
    assert "other 2304 were dropped at the gossip layer" in text  # 2432 - 64 - 64


def test_demo_builds_the_tiny_model_in_its_workdir_once(tmp_path, tiny_model_dir,
                                                        monkeypatch):
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # demo_model sets it if unset
    built = demo.demo_model("tiny", tmp_path)
    assert built == tmp_path / "model"
    assert sorted(p.name for p in built.iterdir()) == sorted(
        p.name for p in tiny_model_dir.iterdir())
    weights = built / "model.safetensors"
    assert weights.read_bytes() == (tiny_model_dir / "model.safetensors").read_bytes()
    stamp = weights.stat().st_mtime_ns
    assert demo.demo_model("tiny", tmp_path) == built  # a second demo reuses it
    assert weights.stat().st_mtime_ns == stamp


@pytest.mark.slow  # three real node processes (~50 s on a busy machine)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_stops_the_demo_with_a_summary(tmp_path, tiny_model_dir, sig):
    """Ctrl-C, and SIGTERM (`timeout`, a supervisor): the same clean stop, no node left
    running (they run in their own sessions). SIGINT is ignored on entry, as in a script's
    background job: Ctrl-C still works. The workdir holds the tiny model already (the demo
    builds it there only when missing: the test above), so the demo process does not
    import torch to build it (10-16 s of its start on a busy machine)."""
    shutil.copytree(tiny_model_dir, tmp_path / "w" / "model")
    env = {**os.environ, "HOME": str(tmp_path), "PYTHONUNBUFFERED": "1"}
    demo = shlex.join([str(Path(sys.executable).parent / "swarm-node"), "demo",
                       "--inference-peers", "1", "--no-cheater", "--workdir",
                       str(tmp_path / "w")])
    proc = subprocess.Popen(["sh", "-c", f"trap '' INT; exec {demo}"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, env=env, text=True)
    lines: list[str] = []
    up = threading.Event()

    def read() -> None:  # the demo's output, line by line: "nodes up" (or its end) wakes us
        for line in proc.stdout:
            lines.append(line)
            if "nodes up" in line:
                up.set()
        up.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert up.wait(300), "".join(lines)
        assert proc.poll() is None and any("nodes up" in ln for ln in lines), "".join(lines)
        proc.send_signal(sig)
        assert proc.wait(timeout=120) == 130
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    reader.join(30)
    text = "".join(lines)
    assert "interrupted at trainer v" in text and "stopping 3 nodes" in text
    assert "swarm-node demo summary" in text and "(interrupted after" in text
    assert "Writing model shards" not in text
    for info in (tmp_path / "w").glob("*/data/node.json"):  # every node process is gone
        pid = json.loads(info.read_text())["pid"]
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
