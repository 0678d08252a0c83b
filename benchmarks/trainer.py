"""Trainer throughput on CPU with the tiny model: completion tokens per second per step.

Fills the buffer with real sampled rollouts (the untrained tiny model, 16 new tokens each),
then times `Trainer.step()` (forward + backward + AdamW; checkpointing timed separately).
With --curve: the learning curve on toy/digit_successor (GRPO, local rollouts only).
Run: .venv/bin/python -m benchmarks.trainer [--threads 2] [--repeats 5] [--curve]
With --smollm2: one forward/backward of the same batch on SmolLM2-135M-Instruct, the
trainer's path (completion positions only, chunked LM head; options: bf16 autocast,
gradient checkpointing) against a plain Hugging Face forward/backward (full logits and
log_softmax at every position).
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
from swarm_node.node.sampler.rounds import sample_round
from swarm_node.node.tasks import TaskSource
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
    ap.add_argument("--smollm2", action="store_true", help="SmolLM2 trainer path vs plain HF")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--variants", default="0,4,1,3,2",
                    help="--smollm2: 0 plain, 1 trainer path (rows apart), 2 + bf16, "
                         "3 + checkpointing, 4 shared prompts")
    ap.add_argument("--section", default="trainer throughput (CPU, SmolLM2)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.curve:
        return learning_curve(args)
    if args.smollm2:
        return smollm2_throughput(args)
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
                # make every group usable (the untrained model's rewards are mostly 0): the
                # trainer scores the decoded token ids, so half the rows get the answer's ids
                for k, s in enumerate(samples):
                    if k % 2 == 0:
                        answer = trainer.rescorer._task(s.task)[0].answer
                        s.completion_ids = tok.encode(answer, add_special_tokens=False) + \
                            [tok.eos_token_id]
                        s.logprobs = torch.full((len(s.completion_ids),), -1.0)
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


def _smollm2_rows(tok, n: int, new_tokens: int, group: int):
    """n rows in GRPO groups of `group` completions per prompt: real rg/basic_arithmetic
    prompts (chat template), random completion tokens."""
    from swarm_node.node.tasks import format_prompt, get_task
    from swarm_node.node.trainer.data import TrainRow
    from swarm_node.protocol.messages import TaskRef

    g = torch.Generator().manual_seed(0)
    rows = []
    for i in range(n):
        ref = TaskRef(dataset="rg/basic_arithmetic", seed=0, index=i // group)
        comp = torch.randint(0, len(tok), (new_tokens,), generator=g).tolist()
        rows.append(TrainRow(format_prompt(tok, get_task(ref)), comp, None,
                             1.0 if i % 2 else -1.0, 1.0, 0.0))
    return rows


def _plain_step(model, batch):
    """What a plain HF trainer does: full logits, full log_softmax, gather, backward."""
    logits = model(input_ids=batch.ids, attention_mask=batch.attention, use_cache=False).logits
    logp_all = torch.log_softmax(logits.float(), dim=-1)
    flat = logp_all.reshape(-1, logp_all.shape[-1])[batch.positions]
    logp = flat.gather(1, batch.targets[:, None])[:, 0]
    return logp


def smollm2_throughput(args) -> None:
    import os

    from swarm_node.node.models import BUILTIN_SMOLLM2, ensure_builtin
    from swarm_node.node.trainer.logprobs import completion_logprobs, pack

    model, tok = load_model(ensure_builtin(BUILTIN_SMOLLM2))
    model.train()
    rows = _smollm2_rows(tok, args.rows, args.new_tokens, args.group_size)
    batch = pack(rows, tok.pad_token_id, "cpu")
    shared = pack(rows, tok.pad_token_id, "cpu", share_prompts=True)
    adv = torch.tensor([r.advantage for r in rows for _ in r.completion_ids])
    n_comp = int(batch.positions.shape[0])
    n_seq = int(batch.attention.sum())
    variants = [
        ("plain HF forward/backward (full logits + log_softmax)",
         lambda: _plain_step(model, batch)),
        ("trainer path: completion positions, chunked LM head",
         lambda: completion_logprobs(model, batch)[0]),
        ("trainer path + bf16 autocast",
         lambda: completion_logprobs(model, batch, bf16_autocast=True)[0]),
        ("trainer path + gradient checkpointing", None),
        ("trainer path + one prompt pass per group (share_prompts, the default)",
         lambda: completion_logprobs(model, shared)[0]),
    ]
    chosen = [variants[int(i)] for i in args.variants.split(",")]
    load0 = os.getloadavg()[0]
    results: dict[str, list[float]] = {}
    for r in range(args.repeats):  # interleaved, so load changes hit every variant alike
        for name, fn in chosen:
            checkpointing = fn is None
            if checkpointing:
                model.gradient_checkpointing_enable(
                    gradient_checkpointing_kwargs={"use_reentrant": False})
                fn = lambda: completion_logprobs(model, batch)[0]
            model.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            loss = -(fn() * adv).mean()
            loss.backward()
            results.setdefault(name, []).append(time.perf_counter() - t0)
            if checkpointing:
                model.gradient_checkpointing_disable()
            print(r, name, round(results[name][-1], 2), flush=True)
            # recorded after every measurement, so a long run that is cut short keeps them
            _record_smollm2(args, results, chosen[0][0], n_comp, n_seq, load0)


def _record_smollm2(args, results, base_name, n_comp, n_seq, load0) -> None:
    import os

    load1 = os.getloadavg()[0]
    base = statistics.median(results[base_name])
    table_rows = [[name, len(ts), f"{statistics.median(ts):.1f}",
                   f"{n_comp / statistics.median(ts):.2f}", f"{n_seq / statistics.median(ts):.1f}",
                   f"{base / statistics.median(ts):.2f}x"] for name, ts in results.items()]
    body = (f"SmolLM2-135M-Instruct (builtin:smollm2-135m, float32 weights), CPU, "
            f"{args.threads} torch threads, one forward+backward of {args.rows} rows "
            f"(GRPO groups: {args.rows // args.group_size} rg/basic_arithmetic chat prompts x "
            f"{args.group_size} completions of {args.new_tokens} tokens; "
            f"{n_comp} completion tokens, {n_seq} tokens in all), loss = -mean(A * logp) "
            f"over completion tokens; median of the runs (interleaved repetitions). "
            f"tokens/s counts completion tokens (the trainer's figure). Load average (1 min) "
            f"before/after: {load0:.1f}/{load1:.1f} on 2 cores shared with other agents' jobs; "
            "absolute times are inflated many times over, the ratio compares like with like. "
            "This CPU has no bf16 units (no avx512_bf16/AMX), so autocast cannot help here.\n\n")
    body += table(["path", "runs", "seconds", "tokens/s", "seq tokens/s", "vs plain"],
                  table_rows)
    record(args.section, body)


if __name__ == "__main__":
    main()
