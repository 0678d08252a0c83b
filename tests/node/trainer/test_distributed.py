"""Multi-process trainer: real torchrun ranks (gloo) on the tiny model.

2 ranks train the same weights as one plain process on the same buffered groups, even across
a SIGKILL of a rank: torchrun restarts the ranks, which resume from the last checkpoint and
lose no buffered group.
"""

from __future__ import annotations

import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from swarm_node.node.config import Config
from swarm_node.node.trainer.buffer import RolloutBuffer
from swarm_node.node.trainer.distributed import BufferWatch, split_by_tokens
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


class Torchrun:
    """torchrun with `procs` ranks in offline mode; its output (every rank's) read line by
    line, so the test waits on what the ranks say."""

    def __init__(self, cfg_path: Path, procs: int, steps: int, restarts: int = 0):
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--standalone",
             f"--nproc-per-node={procs}", f"--max-restarts={restarts}",
             "--monitor-interval=0.2", "-m", "swarm_node.node.ranks", "--config",
             str(cfg_path), "--offline-steps", str(steps)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self._new: queue.Queue = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            self._new.put(line)
        self._new.put(None)

    def expect(self, text: str, timeout: float) -> str:
        """The next output line that contains `text`."""
        while True:
            try:
                line = self._new.get(timeout=timeout)
            except queue.Empty:
                line = None
            if line is None:
                self.proc.kill()
                pytest.fail(f"torchrun said no {text!r} within {timeout:.0f} s (or exited):\n"
                            f"{''.join(self.lines)[-4000:]}")
            if text in line:
                return line

    def finish(self, timeout: float = 240) -> str:
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            self._reader.join(10)
            pytest.fail(f"torchrun did not finish:\n{''.join(self.lines)[-4000:]}")
        self._reader.join(10)
        out = "".join(self.lines)
        assert self.proc.returncode == 0, out[-4000:]
        return out


def weights(data_dir: Path, version: int) -> dict[str, torch.Tensor]:
    path = data_dir / "trainer" / "checkpoints" / f"step-{version:08d}" / "policy"
    return load_file(str(path / "model.safetensors"))


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
    meanwhile (the write to the buffer wakes rank 0). Same weights as one plain process on
    the same 16 groups; no group lost."""
    one, two = tmp_path / "one", tmp_path / "two"
    cfg1, cfg2 = make_config(tiny_model_dir, one), make_config(tiny_model_dir, two)
    fill(cfg1, tiny_model_dir, 0, 8)                       # two steps' worth
    shutil.copytree(one, two)
    later = fill(make_config(tiny_model_dir, tmp_path / "scratch"), tiny_model_dir, 8, 8)
    buf = RolloutBuffer(one / "trainer" / "buffer.sqlite")
    buf.add(later)
    buf.close()
    (tmp_path / "two.toml").write_text(cfg2.to_toml())
    run = Torchrun(tmp_path / "two.toml", procs=2, steps=4, restarts=2)
    ranks = two / "trainer" / "ranks"
    try:
        t = Trainer(cfg1, tiny_model_dir, one, policy_id="me")  # the plain single process
        try:
            for _ in range(4):
                assert t.step().trained
        finally:
            t.close()
        run.expect('{"version": 2,', 180)                  # checkpoint 2 is written
        pid, restart = (ranks / "rank-1.pid").read_text().split()
        assert restart == "0"
        os.kill(int(pid), signal.SIGKILL)                  # rank 1 dies while rank 0 waits
        run.expect("the other ranks are ready", 120)        # torchrun restarted both ranks
        assert (ranks / "rank-1.pid").read_text().split()[1] == "1"
        buf = RolloutBuffer(two / "trainer" / "buffer.sqlite")
        buf.add(later)                                     # accepted after the restart
        buf.close()
    except BaseException:
        run.proc.kill()
        raise
    out = run.finish()
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


def test_buffer_watch_wakes_on_another_writer_not_on_an_idle_step(tiny_model_dir, tmp_path):
    """What run_offline waits on: a commit by another connection (another process in
    production) is seen at once; the waiting trainer's own step on an empty buffer is not."""
    cfg = make_config(tiny_model_dir, tmp_path / "d")
    groups = fill(make_config(tiny_model_dir, tmp_path / "src"), tiny_model_dir, 0, 1)
    t = Trainer(cfg, tiny_model_dir, cfg.data_dir, policy_id="me")
    watch = BufferWatch(t.buffer.path.parent)
    try:
        assert watch.fd >= 0, "inotify is available on Linux"  # (the suite runs on Linux)
        watch.drain()
        assert not t.step().trained
        assert not watch.wait(0)                           # its own idle step: no wake-up
        other = RolloutBuffer(t.buffer.path)
        other.add(groups)
        other.close()
        assert watch.wait(0)                               # queued when add() returned
        watch.drain()
        assert not watch.wait(0)
        assert t.step().trained
    finally:
        watch.close()
        t.close()
