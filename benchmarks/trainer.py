"""Trainer throughput on CPU with the tiny model: completion tokens per second per step.

Fills the buffer with real sampled rollouts (the untrained tiny model, 16 new tokens each),
then times `Trainer.step()` (forward + backward + AdamW; checkpointing timed separately).
Run: .venv/bin/python benchmarks/trainer.py [--threads 2] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.results import record, table
from swarm_node.node.config import Config
from swarm_node.node.models import build_tiny_model, load_model
from swarm_node.node.sampler.hf import HFSampler
from swarm_node.node.tasks import TaskSource
from swarm_node.node.trainer.loop import sample_round
from swarm_node.node.trainer.trainer import Trainer
from swarm_node.protocol.messages import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=16)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / "model", seed=0)
        model, tok = load_model(model_dir)
        sampler = HFSampler(model, tok, peer_id="bench", capture_hidden=False)
        params = SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens)
        source = TaskSource({"toy/digit_successor": 1.0}, "bench")
        for groups in (4, 8, 16, 32):
            cfg = Config.model_validate({
                "trainer": {"local_items": groups, "external_items": 0,
                            "checkpoint_every": 10_000, "max_staleness": 10_000},
                "model": {"device": "cpu"}})
            trainer = Trainer(cfg, model_dir, Path(tmp) / f"data-{groups}")
            times, toks, all_toks = [], [], []
            for r in range(args.repeats + 1):
                samples = sample_round(sampler, tok, source, "bench", r, groups,
                                       args.group_size, params)
                # make every group usable (the untrained model's rewards are mostly 0)
                for k, s in enumerate(samples):
                    if k % 2 == 0:
                        s.text = trainer.rescorer._task(s.task)[0].answer
                trainer.add_local(samples)
                stats = trainer.step()
                if r == 0:
                    continue  # warm-up
                times.append(stats.seconds)
                toks.append(stats.tokens)
                all_toks.append(stats.tokens + sum(len(s.prompt_ids) for s in samples))
            t_ck = time.perf_counter()
            trainer._checkpoint()
            ck_s = time.perf_counter() - t_ck
            trainer.close()
            med = statistics.median(times)
            rows.append([groups, groups * args.group_size, int(statistics.mean(toks)),
                         med * 1000, statistics.mean(toks) / med,
                         statistics.mean(all_toks) / med, ck_s * 1000])
            print(rows[-1], flush=True)
    nparams = sum(p.numel() for p in model.parameters())
    body = (f"Tiny model ({nparams/1e6:.2f} M parameters), float32, {args.threads} torch "
            f"threads, group size {args.group_size}, {args.new_tokens} new tokens per "
            f"completion, 1 AdamW update per step, median of {args.repeats} steps after one "
            "warm-up. `tokens/s` counts completion tokens trained on; `seq tokens/s` also "
            "counts the prompt tokens that go through forward/backward.\n\n")
    body += table(["groups/step", "completions", "completion tokens", "step ms",
                   "tokens/s", "seq tokens/s", "checkpoint ms"], rows)
    record("trainer throughput (CPU, tiny model)", body)


if __name__ == "__main__":
    main()
