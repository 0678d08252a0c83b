"""Verdicts reach the peer (issue 14): an honest inference peer whose task mix differs from
the trainer's sees, in its own /status, log and dashboard, what the trainer rejected and
why, and it is not banned for a configuration difference. Two real `swarm-node join`
processes on loopback (trainer + inference peer) with the tiny model.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from swarm_node.verifier.reasons import REASONS

from .test_operator import Node, trainer_config, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_peer_with_another_task_mix_sees_why_in_its_status(tmp_path, tiny_model_dir):
    tcfg = trainer_config(tmp_path / "t", tiny_model_dir, peer_batches_per_step=1,
                          peer_wait_s=10.0)
    trainer = Node(tmp_path / "t", tcfg).start()
    peer = None
    try:
        info = trainer.wait_listening()  # the peer starts while the trainer loads
        boot = info["listen_addrs"][0]
        pcfg = {
            "node": {"role": "inference", "swarm_id": tcfg["node"]["swarm_id"],
                     "data_dir": str(tmp_path / "p" / "data"),
                     "listen": ["/ip4/127.0.0.1/tcp/0"], "bootstrap": [boot],
                     "follow": [info["peer_id"]]},
            "model": {"name": str(tiny_model_dir)},
            "admin": {"port": 0},
            # the honest mistake: another task family than the trainer's
            "tasks": {"mix": {"toy/digit_copy": 1.0}, "tasks_per_round": 4},
            "sampler": {"completions_per_task": 4, "max_new_tokens": 2,
                        "batches_per_version": 1, "version_wait_s": 5.0},
        }
        peer = Node(tmp_path / "p", pcfg).start()
        trainer.wait_joined()
        peer.wait_joined()

        def rejected():
            mine = peer.status().get("verdicts_about_me") or {}
            return mine.get("rejected") or None

        reasons = wait_for(rejected, 240, "a verdict about the peer's rollouts in its /status",
                           peer.proc, peer.log)
        assert all(r in REASONS or r == "banned" for r in reasons), reasons
        assert "config_task_mix" in reasons, reasons
        mine = peer.status()["verdicts_about_me"]
        assert info["peer_id"] in mine["by_trainer"]
        assert not mine["banned_by"], "an honest misconfiguration must not be banned"
        log = peer.log.read_text()
        assert "config_task_mix" in log and f"trainer {info['peer_id'][-8:]}" in log
        # its explicit task mix differs from the swarm's: the policy is refused, and the
        # dashboard and `swarm-node status` say so first, with the fix
        alerts = wait_for(lambda: [a for a in peer.status().get("alerts", [])
                                   if a["code"] == "settings_refused"], 60, "the refusal")
        assert "tasks.mix" in alerts[0]["detail"] and "remove the differing" in alerts[0]["fix"]
        _screenshot_dashboard(peer, tmp_path)
    finally:
        if peer is not None:
            peer.stop()
        trainer.stop()


def _screenshot_dashboard(node: Node, tmp_path: Path) -> None:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        return
    url = f"http://127.0.0.1:{node.admin_port}/dashboard"
    flags = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
             f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=6000",
             "--window-size=1100,1000"]
    dom = subprocess.run([*flags, "--dump-dom", url], capture_output=True, text=True,
                         timeout=120, check=False).stdout
    verdicts = dom.split('id="verdicts"')[1].split("</table>")[0]
    assert "config_task_mix" in verdicts
    assert 'data-codes="settings_refused' in dom and "Policy refused" in dom
    shot = os.environ.get("SWARM_VERDICTS_PNG")
    if shot:
        subprocess.run([*flags, f"--screenshot={shot}", url], capture_output=True, timeout=120, check=False)
