"""Multi-process trainer: real torchrun ranks (gloo) on the tiny model.

2 ranks train the same weights as one plain process on the same buffered groups, even across
a SIGKILL of a rank: torchrun restarts the ranks, which resume from the last checkpoint and
lose no buffered group.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from swarm_node.node.config import Config
from swarm_node.node.trainer.buffer import RolloutBuffer
from swarm_node.node.trainer.distributed import split_by_tokens
from swarm_node.node.trainer.trainer import Trainer

from .helpers import mixed_group

pytestmark = pytest.mark.slow


def make_config(model_dir: Path, data_dir: Path) -> Config:
    return Config.model_validate({
        "node": {"data_dir": str(data_dir)},
        "model": {"name": str(model_dir), "device": "cpu"},
        "trainer": {"local_items": 4, "external_items": 0, "max_staleness": 50,
                    "micro_batch_size": 3, "learning_rate": 1e-2, "checkpoint_every": 1,
                    "keep_checkpoints": 10}})


def fill(cfg: Config, model_dir: Path, first: int, n: int) -> list:
    """n groups of the tiny model's tokens, rewards 1/0/1/0, added to cfg's buffer."""
    t = Trainer(cfg, model_dir, cfg.data_dir, policy_id="me")
    try:
        for i in range(first, first + n):
            # groups of 2..5 completions: uneven shares across ranks
            t.add_local(mixed_group(t.tokenizer, i, g=2 + i % 4))
        return t.buffer.pending()
    finally:
        t.close()


def torchrun(cfg_path: Path, procs: int, steps: int, restarts: int = 0) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         f"--nproc-per-node={procs}", f"--max-restarts={restarts}", "--monitor-interval=0.2",
         "-m", "swarm_node.node.ranks", "--config", str(cfg_path),
         "--offline-steps", str(steps)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(proc: subprocess.Popen, timeout: float = 240) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"torchrun did not finish:\n{out[-4000:]}")
    assert proc.returncode == 0, out[-4000:]
    return out


def weights(data_dir: Path, version: int) -> dict[str, torch.Tensor]:
    path = data_dir / "trainer" / "checkpoints" / f"step-{version:08d}" / "policy"
    return load_file(str(path / "model.safetensors"))


def wait_for(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.1)


def test_split_by_tokens_is_balanced_and_complete(tiny_model_dir, tmp_path):
    cfg = make_config(tiny_model_dir, tmp_path / "d")
    groups = fill(cfg, tiny_model_dir, 0, 7)
    shares = split_by_tokens(groups, 2)
    assert sorted(g.id for s in shares for g in s) == sorted(g.id for g in groups)
    loads = [sum(len(c.completion_ids) for g in s for c in g.completions) for s in shares]
    biggest = max(sum(len(c.completion_ids) for c in g.completions) for g in groups)
    assert abs(loads[0] - loads[1]) <= biggest
    assert split_by_tokens(groups, 2) == shares  # deterministic: every rank computes it


def test_two_ranks_match_one_process_through_a_sigkill_restart(tiny_model_dir, tmp_path):
    """2 ranks train 2 steps; rank 1 is SIGKILLed while rank 0 waits for groups; torchrun
    restarts both, they resume from checkpoint 2 and train 2 more steps on groups accepted
    meanwhile. Same weights as one plain process on the same 16 groups; no group lost."""
    one, two = tmp_path / "one", tmp_path / "two"
    cfg1, cfg2 = make_config(tiny_model_dir, one), make_config(tiny_model_dir, two)
    fill(cfg1, tiny_model_dir, 0, 8)                       # two steps' worth
    shutil.copytree(one, two)
    later = fill(make_config(tiny_model_dir, tmp_path / "scratch"), tiny_model_dir, 8, 8)
    buf = RolloutBuffer(one / "trainer" / "buffer.sqlite")
    buf.add(later)
    buf.close()
    (tmp_path / "two.toml").write_text(cfg2.to_toml())
    proc = torchrun(tmp_path / "two.toml", procs=2, steps=4, restarts=2)
    ranks, ckpts = two / "trainer" / "ranks", two / "trainer" / "checkpoints"
    try:
        t = Trainer(cfg1, tiny_model_dir, one, policy_id="me")  # the plain single process
        try:
            for _ in range(4):
                assert t.step().trained
        finally:
            t.close()
        wait_for(lambda: (ckpts / "step-00000002").is_dir(), 180, "version 2")
        pid, restart = (ranks / "rank-1.pid").read_text().split()
        assert restart == "0"
        os.kill(int(pid), signal.SIGKILL)                  # rank 1 dies while rank 0 waits
        wait_for(lambda: (ranks / "rank-1.pid").read_text().split()[1] == "1", 120,
                 "torchrun to restart the ranks")
        buf = RolloutBuffer(two / "trainer" / "buffer.sqlite")
        buf.add(later)                                     # accepted while the ranks restart
        buf.close()
    except BaseException:
        proc.kill()
        raise
    out = finish(proc)
    versions = [int(line.split('"version": ')[1].split(",")[0])
                for line in out.splitlines() if line.startswith('{"version"')]
    assert versions == [1, 2, 3, 4], out[-3000:]          # resumed at 2, nothing retrained

    start, single, ranked = weights(one, 0), weights(one, 4), weights(two, 4)
    assert any(not torch.equal(start[k], single[k]) for k in start)  # it did train
    for k in single:
        torch.testing.assert_close(ranked[k], single[k], rtol=1e-4, atol=1e-5, msg=k)
    for d in (one, two):                                   # every group trained once
        buf = RolloutBuffer(d / "trainer" / "buffer.sqlite")
        assert buf.count() == 0 and buf.counters()["trained"] == 16
        buf.close()
