"""A trainer on a full disk pauses and resumes (issue 30 finding 13): real `swarm-node join`
processes (tiny model), the trainer's data dir on a small tmpfs that the test fills while
an honest inference peer keeps sending rounds. The seen-rollout store's commit failing with
"database or disk is full" used to end the process ("cannot rollback"); now the trainer
says it paused, stays up while the disk is full, and accepts the peer's work again once
space is freed. Needs root to mount a tmpfs: skipped with the reason otherwise."""

from __future__ import annotations

from pathlib import Path

import pytest

from .test_operator import Node, trainer_config, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def fill(path: Path) -> int:
    """Write `path` until the filesystem is full; returns the bytes written."""
    n = 0
    with open(path, "wb") as f:
        try:
            while True:
                f.write(b"\0" * (1 << 20))
                f.flush()
                n += 1 << 20
        except OSError:
            pass
    return n


def test_13_a_trainer_on_a_full_disk_pauses_and_resumes(tmp_path, small_disk, tiny_model_dir):
    tcfg = trainer_config(tmp_path / "t", tiny_model_dir, peer_batches_per_step=1,
                          peer_wait_s=5.0)
    tcfg["node"]["data_dir"] = str(small_disk / "data")
    tcfg["node"]["min_free_disk_mib"] = 1
    tcfg["sampler"]["batches_per_version"] = 4
    trainer = Node(tmp_path / "t", tcfg).start()
    peer = None
    try:
        info = trainer.wait_listening()  # the peer starts while the trainer loads
        tid, boot = info["peer_id"], info["listen_addrs"][0]
        peer = Node(tmp_path / "p", {
            "node": {"role": "inference", "swarm_id": tcfg["node"]["swarm_id"],
                     "data_dir": str(tmp_path / "p" / "data"),
                     "listen": ["/ip4/127.0.0.1/tcp/0"], "bootstrap": [boot],
                     "follow": [tid]},
            "model": {"name": str(tiny_model_dir)}, "admin": {"port": 0},
            "tasks": tcfg["tasks"], "sampler": {**tcfg["sampler"], "version_wait_s": 5.0},
        }).start()
        trainer.wait_joined()
        peer.wait_joined()

        def accepted() -> int:
            return trainer.status().get("rollouts_accepted", 0)

        wait_for(lambda: accepted() >= 8, 300, "accepted rounds", trainer.proc, trainer.log)
        filled = fill(small_disk / "filler")
        assert filled > 0

        def paused() -> bool:
            return bool(((trainer.status().get("extra") or {}).get("disk") or {}).get("paused"))

        wait_for(paused, 300, "the trainer to pause on the full disk", trainer.proc,
                 trainer.log)
        # what the failed write gave back (a partial checkpoint removed: a few MiB) is taken
        # too, so the disk stays full: a retry then waits for space, it never gets it
        fill(small_disk / "filler2")
        since = trainer.status()["uptime_s"]
        # the disk stays full for 15 s of the trainer's own clock (the finding's trainer
        # died at the next verified batch, seconds after the first failed commit; 15 space
        # checks, 3 of the peer's version waits): it stays up, paused, keeping the verified
        # batch it could not record
        wait_for(lambda: trainer.status().get("uptime_s", 0) >= since + 15, 300,
                 "15 s on the full disk", trainer.proc, trainer.log)
        assert trainer.proc.poll() is None and paused()
        during = accepted()
        (small_disk / "filler").unlink()
        (small_disk / "filler2").unlink()
        wait_for(lambda: not paused() and accepted() > during, 300,
                 "the trainer to resume and accept again", trainer.proc, trainer.log)
        log = trainer.log.read_text()
        assert "disk full:" in log and "disk space back:" in log
        assert "Traceback" not in log and "cannot rollback" not in log
    finally:
        if peer is not None:
            peer.stop()
        trainer.stop()  # before the fixture unmounts the disk
