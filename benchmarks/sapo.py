"""The SAPO table at toy scale: does sharing rollouts beat training alone?

4 nodes in one process group, each with its own policy (same tiny initial model), its own
task subset and its own trainer (on-disk buffer, checkpoints). Every round each node samples
`tasks` x `group` completions of its own tasks with its own policy, publishes them as a
RolloutBatch, and trains once on I local + J external groups (external = the other nodes'
batches of this round and the last, re-tokenised and re-scored by the receiver).
Task subsets (--subsets): `specialised` (default): node 0 digit_successor, node 1
digit_predecessor, node 2 digit_copy, node 3 an equal mix of the three; `shared`: every node
the three-family mix, drawing its own tasks. Reward: each node's own rollouts on its own tasks. Cumulative reward
= sum over nodes and rounds of the node's mean reward in that round (max 4 x rounds).

`--model smollm2`: every node starts from SmolLM2-135M-Instruct and trains on learning.py's
task (rg/basic_arithmetic, one-digit + and -), prompt style (system prompt `direct`, 2 worked
examples), lr 1e-5, at most 10 new tokens and format reward 0. Each node draws its own tasks
(TaskSource by peer ID), never one whose question is in the held-out set; node 0's held-out
greedy accuracy (learning.py's eval) is measured before the first and after the last round.
Each node's sampler shares its trainer's model, like the trainer role's own sampler.

Run: .venv/bin/python -m benchmarks.sapo [--rounds 50] [--seeds 0 1 2] [--workers 2]
     .venv/bin/python -m benchmarks.sapo --model smollm2 --configs 8/0 4/4 --seeds 0 \
         --rounds 4 --tasks 8 --group 8
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # also runnable as a plain script
    sys.path.insert(0, str(ROOT))

import argparse
import json
import os
import statistics
import tempfile
import time
from multiprocessing import get_context

CONFIGS = [(8, 0), (6, 2), (4, 4), (2, 6)]
MIX3 = {"toy/digit_successor": 1.0, "toy/digit_predecessor": 1.0, "toy/digit_copy": 1.0}
SUBSETS = {
    # each node its own task family (the fourth: all three)
    "specialised": [{"toy/digit_successor": 1.0}, {"toy/digit_predecessor": 1.0},
                    {"toy/digit_copy": 1.0}, MIX3],
    # every node the same three-family mix; each still draws its own tasks (by peer ID)
    "shared": [MIX3] * 4,
}


def run(job: dict) -> dict:
    if job.get("model", "tiny") == "smollm2":
        return run_smollm2(job)
    import torch
    from swarm_node.node.config import Config
    from swarm_node.node.models import build_tiny_model, load_model
    from swarm_node.node.sampler.hf import HFSampler
    from swarm_node.node.sampler.rounds import sample_round
    from swarm_node.node.tasks import TaskSource
    from swarm_node.node.trainer.loop import sync_sampler
    from swarm_node.node.trainer.trainer import Trainer
    from swarm_node.protocol.messages import SamplingParams

    torch.set_num_threads(1)
    local, external, seed = job["local"], job["external"], job["seed"]
    torch.manual_seed(seed)
    params = SamplingParams(temperature=1.0, max_new_tokens=job["max_new_tokens"])
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / "model", seed=0)
        nodes = []
        for k, mix in enumerate(SUBSETS[job["subsets"]]):
            cfg = Config.model_validate({
                "trainer": {"learning_rate": job["lr"], "local_items": local,
                            "external_items": external, "external_selection": job["selection"],
                            "max_staleness": 1, "checkpoint_every": 10_000, "seed": seed * 10 + k},
                "model": {"device": "cpu"}})
            peer = f"node{k}-seed{seed}"
            trainer = Trainer(cfg, model_dir, Path(tmp) / f"node{k}", policy_id=peer)
            model, tok = load_model(model_dir)
            sampler = HFSampler(model, tok, peer_id=peer, capture_hidden=False)
            nodes.append((peer, trainer, sampler, tok, TaskSource(mix, f"sapo-{seed}")))
        curve = []
        for r in range(job["rounds"]):
            batches, rewards = [], []
            for peer, trainer, sampler, tok, source in nodes:
                sync_sampler(sampler, trainer)
                samples = sample_round(sampler, tok, source, peer, r, job["tasks"],
                                       job["group"], params)
                reward, batch = _keep_local(trainer, samples, peer, r, params)
                rewards.append(reward)
                batches.append(batch)
            _share_and_step([node[1] for node in nodes], batches, external)
            curve.append(rewards)
        for _, trainer, *_rest in nodes:
            trainer.close()
    return {**job, "curve": curve, "seconds": time.perf_counter() - t0}


def _keep_local(trainer, samples, peer: str, round_: int, params) -> tuple[float, object]:
    """Adds a node's own samples to its trainer; returns their mean reward and the batch it shares."""
    from swarm_node.node.sampler.rounds import to_batch

    trainer.add_local(samples)
    reward = statistics.mean(trainer.rescorer.score(s.task, s.text) for s in samples)
    return reward, to_batch(samples, "sapo", peer, round_, params)


def run_smollm2(job: dict) -> dict:
    """The same rounds on SmolLM2 with learning.py's task, prompts and trainer settings."""
    import torch
    from swarm_node.node.models import BUILTIN_SMOLLM2, ensure_builtin
    from swarm_node.node.sampler.hf import HFSampler
    from swarm_node.node.tasks import TaskSource, get_task
    from swarm_node.node.trainer.evaluate import EVAL_SEED
    from swarm_node.node.trainer.trainer import Trainer
    from swarm_node.protocol.messages import SamplingParams

    from benchmarks import learning

    torch.set_num_threads(job["threads"])
    local, external, seed = job["local"], job["external"], job["seed"]
    torch.manual_seed(seed)
    params = SamplingParams(temperature=1.0, max_new_tokens=job["max_new_tokens"])
    eval_refs = learning.refs(EVAL_SEED, 0, job["eval"])
    held_out = {get_task(r).prompt for r in eval_refs}
    source = TaskSource({learning.DATASET: 1.0}, f"sapo-{seed}",
                        params={learning.DATASET: learning.PARAMS})
    model_dir = ensure_builtin(BUILTIN_SMOLLM2)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        nodes = []
        for k in range(4):
            peer = f"node{k}-seed{seed}"
            trainer = Trainer(_smollm2_config(job, k), model_dir, Path(tmp) / f"node{k}",
                              policy_id=peer)
            # shares the trainer's model object: no weight copy per round
            sampler = HFSampler(trainer.model, trainer.tokenizer, peer_id=peer,
                                capture_hidden=False)
            nodes.append((peer, trainer, sampler))
        evals = {}
        if job["eval"]:
            evals["before"] = learning._eval(nodes[0][1], nodes[0][2], nodes[0][1].tokenizer,
                                             eval_refs, job["max_new_tokens"])
        curve, round_s = [], []
        for r in range(job["rounds"]):
            t_round = time.perf_counter()
            batches, rewards = [], []
            for peer, trainer, sampler in nodes:
                refs = _draw(source, peer, r, job["tasks"], held_out)
                samples = _sample(trainer, sampler, refs, job["group"], params)
                reward, batch = _keep_local(trainer, samples, peer, r, params)
                rewards.append(reward)
                batches.append(batch)
            _share_and_step([node[1] for node in nodes], batches, external)
            curve.append(rewards)
            round_s.append(time.perf_counter() - t_round)
            print(f"{local}/{external} seed {seed} round {r}: rewards "
                  f"{[round(x, 3) for x in rewards]} ({round_s[-1]:.0f} s)", flush=True)
        if job["eval"]:
            evals["after"] = learning._eval(nodes[0][1], nodes[0][2], nodes[0][1].tokenizer,
                                            eval_refs, job["max_new_tokens"])
        for _, trainer, _sampler in nodes:
            trainer.close()
    return {**job, "curve": curve, "round_seconds": round_s, "eval_node0": evals,
            "seconds": time.perf_counter() - t0}


def _smollm2_config(job: dict, k: int):
    from swarm_node.node.config import Config

    from benchmarks import learning

    return Config.model_validate({
        "model": {"device": "cpu"},
        "tasks": {"format_reward": job["format_reward"], "system_prompt": job["system_prompt"],
                  "few_shot": job["few_shot"], "mix": {learning.DATASET: 1.0},
                  "params": {learning.DATASET: learning.PARAMS}},
        "trainer": {"learning_rate": job["lr"], "local_items": job["local"],
                    "external_items": job["external"], "external_selection": job["selection"],
                    "max_staleness": 1, "checkpoint_every": 100_000, "micro_batch_size": 8,
                    "seed": job["seed"] * 10 + k}})


def _draw(source, peer: str, round_: int, n: int, held_out: set[str]) -> list:
    """The node's tasks of this round (its own draw), skipping held-out questions."""
    from swarm_node.node.tasks import get_task

    out = []
    for i in range(source.max_per_round):
        ref = source.ref_at(peer, round_, i)
        if get_task(ref).prompt not in held_out:
            out.append(ref)
            if len(out) == n:
                return out
    raise RuntimeError(f"fewer than {n} tasks outside the held-out set for {peer} round {round_}")


def _sample(trainer, sampler, refs, group: int, params) -> list:
    from swarm_node.node.tasks import PromptStyle, format_prompt, get_task

    style = PromptStyle.of(trainer.config.tasks)
    prompts = [(r, format_prompt(trainer.tokenizer, get_task(r, style=style))) for r in refs]
    sampler.version = trainer.version
    trainer.model.eval()
    try:
        return [s for row in sampler.generate(prompts, group, params) for s in row]
    finally:
        trainer.model.train()


# per-model defaults of the options left unset (smollm2: benchmarks/learning.py's settings)
DEFAULTS = {
    "tiny": {"lr": 3e-3, "max_new_tokens": 2, "out": "benchmarks/sapo_runs.json"},
    "smollm2": {"lr": 1e-5, "max_new_tokens": 10, "out": "benchmarks/sapo_smollm2_runs.json"},
}



def _share_and_step(trainers: list, batches: list, external: int) -> None:
    """Each node takes the other nodes' batches of this round (when it trains on external
    groups) and steps once on its I local + J external groups."""
    for k, trainer in enumerate(trainers):
        if external > 0:
            for j, batch in enumerate(batches):
                if j != k:
                    trainer.add_external(batch)
        trainer.step()

def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny", choices=sorted(DEFAULTS))
    ap.add_argument("--configs", nargs="+", default=[f"{i}/{j}" for i, j in CONFIGS],
                    help="local/external mixes to run, e.g. 8/0 4/4")
    ap.add_argument("--rounds", type=int, default=50)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--tasks", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--lr", type=float, default=None, help="tiny 3e-3, smollm2 1e-5")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="tiny 2, smollm2 10")
    ap.add_argument("--selection", default="uniform", choices=["uniform", "variance"])
    ap.add_argument("--subsets", default="specialised", choices=sorted(SUBSETS),
                    help="tiny model only")
    ap.add_argument("--system-prompt", default="direct", help="smollm2 only (learning.py's)")
    ap.add_argument("--few-shot", type=int, default=2, help="smollm2 only (learning.py's)")
    ap.add_argument("--format-reward", type=float, default=0.0, help="smollm2 only")
    ap.add_argument("--eval", type=int, default=32,
                    help="smollm2: held-out problems for node 0's greedy accuracy (0: skip)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--out", default=None)
    ap.add_argument("--no-record", action="store_true")
    ap.add_argument("--report-only", action="store_true", help="record the runs in --out")
    args = ap.parse_args()
    for key, value in DEFAULTS[args.model].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.report_only:
        return report(json.loads(Path(args.out).read_text()), args)
    configs = [tuple(int(x) for x in c.split("/")) for c in args.configs]
    jobs = [{"local": i, "external": j, "seed": s, "rounds": args.rounds, "tasks": args.tasks,
             "group": args.group, "lr": args.lr, "max_new_tokens": args.max_new_tokens,
             "selection": args.selection, "subsets": args.subsets, "model": args.model,
             "system_prompt": args.system_prompt, "few_shot": args.few_shot,
             "format_reward": args.format_reward, "eval": args.eval, "threads": args.threads,
             "workers": args.workers}
            for s in args.seeds for i, j in configs]
    load0 = os.getloadavg()
    with get_context("spawn").Pool(args.workers) as pool:
        results = []
        for res in pool.imap_unordered(run, jobs):
            cum = sum(sum(r) for r in res["curve"])
            print(f"{res['local']}/{res['external']} seed {res['seed']}: cumulative "
                  f"{cum:.2f} ({res['seconds']:.0f} s) {res.get('eval_node0', '')}", flush=True)
            results.append({**res, "load_before": load0, "load_after": os.getloadavg()})
            Path(args.out).write_text(json.dumps(results))  # each finished run kept at once
    if not args.no_record:
        report(results, args)


def report(results: list[dict], args) -> None:
    if results[0].get("model", "tiny") == "smollm2":
        return report_smollm2(results, args)
    from benchmarks.results import record, table

    rows, curves = [], {}
    base = None
    for i, j in _present(results):
        runs = sorted((r for r in results if (r["local"], r["external"]) == (i, j)),
                      key=lambda r: r["seed"])
        cums = [sum(sum(x) for x in r["curve"]) for r in runs]
        mean = statistics.mean(cums)
        if (i, j) == (8, 0):
            base = mean
        tail = max(1, args.rounds // 10)
        last = [statistics.mean(statistics.mean(x) for x in r["curve"][-tail:]) for r in runs]
        rows.append([f"{i}/{j}", ", ".join(f"{c:.2f}" for c in cums), mean,
                     statistics.pstdev(cums), f"{100 * (mean / base - 1):+.0f}%" if base else "",
                     statistics.mean(last)])
        rounds = len(runs[0]["curve"])
        curves[f"{i}/{j}"] = [statistics.mean(statistics.mean(r["curve"][t]) for r in runs)
                              for t in range(rounds)]
    step = max(1, args.rounds // 10)
    marks = list(range(0, args.rounds, step)) + [args.rounds - 1]
    curve_rows = [[f"{k}"] + [curves[k][t] for t in marks] for k in curves]
    subsets = results[0].get("subsets", "specialised")
    what = ("successor / predecessor / copy / mix of the three" if subsets == "specialised"
            else "all nodes the same three-family mix, each drawing its own tasks")
    body = (f"4 nodes in-process (tiny model, one CPU thread each), node task subsets "
            f"`{subsets}`: {what}; {args.tasks} tasks x "
            f"{args.group} completions per node per round, {args.rounds} rounds, lr {args.lr}, "
            f"max {args.max_new_tokens} new tokens, external selection `{args.selection}`, "
            f"max_staleness 1. Cumulative reward = sum over nodes and rounds of each node's "
            f"mean reward on its own rollouts (max {4 * args.rounds}). Seeds "
            f"{args.seeds}. Paper (8 x Qwen2.5-0.5B, 2000 rounds): 4/4 +94% over 8/0.\n\n")
    body += table(["local/external", "cumulative per seed", "mean", "std", "vs 8/0",
                   "mean reward, last 10% of rounds"], rows)
    body += "\n\nLearning curve (mean reward per round, averaged over nodes and seeds):\n\n"
    body += table(["config"] + [f"r{t}" for t in marks], curve_rows)
    record(f"SAPO local/external mix (toy scale, {subsets} subsets, selection "
           f"{args.selection})", body)



def _present(results: list[dict]) -> list[tuple[int, int]]:
    """The local/external mixes that `results` holds, in CONFIGS order (others after)."""
    have = {(r["local"], r["external"]) for r in results}
    return [c for c in CONFIGS if c in have] + sorted(have - set(CONFIGS), reverse=True)


def report_smollm2(results: list[dict], args) -> None:
    from benchmarks.results import record, table

    rows, curves, base = [], {}, None
    for i, j in _present(results):
        runs = sorted((r for r in results if (r["local"], r["external"]) == (i, j)),
                      key=lambda r: r["seed"])
        cums = [sum(sum(x) for x in r["curve"]) for r in runs]
        mean = statistics.mean(cums)
        base = mean if (i, j) == (8, 0) else base
        evals = [r.get("eval_node0") or {} for r in runs]
        held = "; ".join(f"{e['before']['exact']:.3f} -> {e['after']['exact']:.3f}"
                         for e in evals if "before" in e and "after" in e)
        rows.append([f"{i}/{j}", ", ".join(f"{c:.2f}" for c in cums), mean,
                     f"{mean / base:.2f}x" if base else "",
                     statistics.mean(statistics.mean(r["curve"][0]) for r in runs),
                     statistics.mean(statistics.mean(r["curve"][-1]) for r in runs),
                     held or "-",
                     statistics.mean(statistics.mean(r["round_seconds"]) for r in runs)])
        curves[f"{i}/{j}"] = [statistics.mean(statistics.mean(r["curve"][t]) for r in runs)
                              for t in range(len(runs[0]["curve"]))]
    job, rounds = results[0], len(results[0]["curve"])
    loads = [results[0]["load_before"][0]] + [r["load_after"][0] for r in results]
    body = (f"4 nodes in one process per config (each its own SmolLM2-135M-Instruct trainer, "
            f"float32, CPU, {job['threads']} torch thread(s) per config, {job['workers']} "
            f"config(s) in parallel); per node per round {job['tasks']} rg/basic_arithmetic problems (one-digit + and -, "
            f"benchmarks/learning.py's params, each node its own draw, never a held-out "
            f"question) x {job['group']} completions (temperature 1, at most "
            f"{job['max_new_tokens']} new tokens), system prompt '{job['system_prompt']}' + "
            f"{job['few_shot']} worked examples, reward = rg score (format reward "
            f"{job['format_reward']:g}), one GRPO step per node per round on I local + J "
            f"external groups (external = the other 3 nodes' groups of this round and, within "
            f"max_staleness 1, the last, re-scored by the receiver; selection "
            f"`{job['selection']}`), lr {job['lr']}. "
            f"{rounds} rounds, seeds {sorted({r['seed'] for r in results})}. Cumulative reward "
            f"= sum over nodes and rounds of each node's mean reward on its own rollouts (max "
            f"{4 * rounds}). Held-out exact: node 0's greedy accuracy (learning.py's eval, "
            f"{job['eval']} problems of generator seed 424242) before the first and after the "
            f"last round. Load average (1 min) at start and at the end of each config: "
            f"{', '.join(f'{x:.1f}' for x in loads)} on 2 cores.\n\n")
    body += table(["local/external", "cumulative per seed", "mean", "vs 8/0",
                   "mean reward, round 0", "mean reward, last round",
                   "node 0 held-out exact before -> after", "seconds per round"], rows)
    body += "\n\nMean reward per round (averaged over the 4 nodes):\n\n"
    body += table(["config"] + [f"r{t}" for t in range(rounds)],
                  [[k] + v for k, v in curves.items()])
    record("SAPO (SmolLM2)", body)


if __name__ == "__main__":
    main()
