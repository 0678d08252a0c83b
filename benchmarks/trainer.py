"""Trainer throughput on CPU with the tiny model: completion tokens per second per step.

Fills the buffer with real sampled rollouts (the untrained tiny model, 16 new tokens each),
then times `Trainer.step()` (forward + backward + AdamW; checkpointing timed separately).
With --curve: the learning curve on toy/digit_successor (GRPO, local rollouts only).
Run: .venv/bin/python -m benchmarks.trainer [--threads 2] [--repeats 5] [--curve]
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # also runnable as a plain script
    sys.path.insert(0, str(ROOT))

import argparse
import statistics
import tempfile
import time

import torch
from swarm_node.node.config import Config
from swarm_node.node.models import build_tiny_model, load_model
from swarm_node.node.sampler.hf import HFSampler
from swarm_node.node.tasks import TaskSource
from swarm_node.node.trainer.loop import sample_round
from swarm_node.node.trainer.trainer import Trainer
from swarm_node.protocol.messages import SamplingParams

from benchmarks.results import record, table


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--curve", action="store_true", help="record the learning curve instead")
    ap.add_argument("--rounds", type=int, default=200)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.curve:
        return learning_curve(args)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / "model", seed=0)
        model, tok = load_model(model_dir)
        sampler = HFSampler(model, tok, peer_id="bench", capture_hidden=False)
        params = SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens)
        source = TaskSource({"toy/digit_successor": 1.0}, "bench")
        for groups in (4, 8, 16):
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


def learning_curve(args) -> None:
    from swarm_node.node.trainer.loop import sync_sampler

    tasks, group, lr = 16, 16, 2e-3
    curve, t0 = [], time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / "model", seed=0)
        cfg = Config.model_validate({
            "trainer": {"learning_rate": lr, "local_items": tasks, "external_items": 0,
                        "checkpoint_every": 50, "seed": 0},
            "model": {"device": "cpu"}})
        trainer = Trainer(cfg, model_dir, Path(tmp) / "data", policy_id="curve")
        model, tok = load_model(model_dir)
        sampler = HFSampler(model, tok, peer_id="curve", capture_hidden=False)
        source = TaskSource({"toy/digit_successor": 1.0}, "curve")
        params = SamplingParams(temperature=1.0, max_new_tokens=2)
        exact = []
        for r in range(args.rounds):
            sync_sampler(sampler, trainer)
            samples = sample_round(sampler, tok, source, "curve", r, tasks, group, params)
            trainer.add_local(samples)
            stats = trainer.step()
            curve.append(stats.mean_reward_local_new)
            exact.append(sum(trainer.rescorer.score(s.task, s.text) == 1.0 for s in samples)
                         / len(samples))
            if r % 10 == 0:
                print(r, round(curve[-1], 3), round(exact[-1], 3), flush=True)
        trainer.close()
    elapsed = time.perf_counter() - t0
    marks = list(range(0, args.rounds, 10)) + [args.rounds - 1]
    win = lambda xs, t: statistics.mean(xs[max(0, t - 4):t + 1])
    rows = [[t, win(curve, t), win(exact, t)] for t in marks]
    body = (f"toy/digit_successor, tiny model from its random init, {tasks} tasks x {group} "
            f"completions per round (temperature 1, max 2 new tokens), one GRPO step per "
            f"round (lr {lr}, defaults otherwise), sampler weights synced every round, "
            f"{args.threads} torch threads; {args.rounds} rounds took {elapsed:.0f} s on a "
            "shared machine. Reward: 1 exact digit, 0.5 right first digit, 0.1 a wrong digit, "
            "0 none; a random policy scores ~0.01. Values are 5-round running means.\n\n")
    body += table(["round", "mean reward", "exact-answer rate"], rows)
    record("trainer learning curve (toy task, CPU)", body)


if __name__ == "__main__":
    main()
