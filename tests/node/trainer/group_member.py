"""Test kit: one trainer-group member as its own process, driven over stdin/stdout.

    python -m tests.node.trainer.group_member SETTINGS_JSON
    stdout  {"event": "started"}                     the trainer is built, its groups buffered
    stdin   join PEERS_JSON -> {"event": "ready", "maddrs", "loaded"} after the group was
                      joined (its hivemind child started, the group's state loaded)
            step   -> {"event": "averaging", "version"} (when its round starts), then
                      {"event": "stepped", "version", "group": <round reply or null>}
            dump P -> the model's current weights to safetensors file P, {"event": "dumped"}
            quit

A real Trainer (tiny model, its own buffered groups) with a real TrainerGroup (hivemind child).
The process builds its trainer at once and joins the group only when told to, so a test can
start every member together and still choose when each one joins.
"""

from __future__ import annotations

import json
import logging
import os
import sys

from safetensors.torch import save_file
from swarm_node.node.config import Config
from swarm_node.node.trainer.group import attach_group
from swarm_node.node.trainer.hooks import StepHooks
from swarm_node.node.trainer.trainer import Trainer

from .helpers import mixed_group


def main() -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    s = json.loads(sys.argv[1])
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)

    def say(**msg):
        out.write(json.dumps(msg) + "\n")
        out.flush()

    def config(peers: list[str]) -> Config:
        return Config.model_validate({
            "node": {"data_dir": s["data_dir"]},
            "model": {"name": s["model_dir"], "device": "cpu"},
            "trainer": {"local_items": 2, "external_items": 0, "max_staleness": 100,
                        "learning_rate": 1e-2, "keep_checkpoints": 10, "group": s["group"],
                        "group_every": 1, "group_key_path": s["key_path"],
                        "group_peers": peers, "group_listen": ["/ip4/127.0.0.1/tcp/0"],
                        "group_timeout_s": s["timeout_s"]}})

    made = []  # the group, joined below; the trainer's after-step hook is fixed at its build
    trainer = Trainer(config([]), s["model_dir"], s["data_dir"], policy_id=s["group"],
                      scale_out=lambda _t: StepHooks(after_step=lambda t: made[0].after_step(t)))
    for i in range(s["first_task"], s["first_task"] + 8):  # each member: its own tasks
        trainer.add_local(mixed_group(trainer.tokenizer, i, g=4))
    say(event="started")
    cmd, _, peers = sys.stdin.readline().partition(" ")
    if cmd != "join":
        trainer.close()
        return
    cfg = config(json.loads(peers))
    group = attach_group(trainer, cfg, cfg.data_dir)
    made.append(group)
    average = group.average

    def announced(version):
        say(event="averaging", version=version)
        return average(version)

    group.average = announced
    say(event="ready", maddrs=group.maddrs, loaded=group.load_reply)
    try:
        for line in sys.stdin:
            cmd = line.split()
            if cmd[0] == "step":
                group.last = None
                stats = trainer.step()
                say(event="stepped", version=stats.version, group=group.last)
            elif cmd[0] == "dump":
                save_file({k: v.clone() for k, v in trainer.state_dict().items()}, cmd[1])
                say(event="dumped")
            elif cmd[0] == "quit":
                break
    finally:
        group.close()
        trainer.close()


if __name__ == "__main__":
    main()
