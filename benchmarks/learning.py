"""Learning you can measure: SmolLM2-135M-Instruct on small-number arithmetic (CPU).

One trainer with its own in-process sampler (the trainer role's local half of a SAPO round):
each round samples `group` completions for `tasks` training problems (temperature 1), adds
them to the trainer (text decoded from token ids, reward from the task's own scorer) and
takes one GRPO step. Before the first and after the last step, greedy completions of a fixed
held-out set (another generator seed; any training problem whose question text appears in
it is skipped) are scored three ways:
  exact    the protocol's reward with format_reward 0 (rg scorer: the <answer> tag, else the
           whole completion, must equal the answer);
  tagged   share of completions with an <answer>...</answer> tag;
  lenient  the last number in the completion equals the answer (diagnostic only: what a
           reader would accept; not what the swarm trains on).
Prompts use reasoning-gym's system prompt --system-prompt (the swarm setting
tasks.system_prompt; "direct" asks for the bare answer in an <answer> tag) and --few-shot
worked examples of the same generator as earlier chat turns (tasks.few_shot): without
them SmolLM2 never writes the tag and the exact reward is 0 everywhere. The training
reward is (1 - f) * rg score + f * tagged with f = --format-reward (default 0: exactly the
protocol's reward): the rg score is 1 for an exact answer and a partial credit of
len(answer)/len(text) when the untagged text contains it, so shorter correct statements
score more, and GRPO's per-group normalisation turns even small differences into a signal.

    python -m benchmarks.learning [--minutes 30] [--tasks 8] [--group 8] [--eval 32]
    python -m benchmarks.learning --base-rates     # start accuracy per prompt style
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # also runnable as a plain script
    sys.path.insert(0, str(ROOT))

import argparse
import os
import statistics
import tempfile
import time

import torch
from swarm_node.node.config import Config
from swarm_node.node.models import BUILTIN_SMOLLM2, ensure_builtin
from swarm_node.node.sampler.hf import HFSampler
from swarm_node.node.tasks import SMALL_ARITHMETIC, PromptStyle, format_prompt, get_task
from swarm_node.node.trainer.evaluate import EVAL_SEED, greedy_accuracy
from swarm_node.node.trainer.trainer import Trainer
from swarm_node.protocol.messages import SamplingParams, TaskRef

from benchmarks.results import record, table

DATASET = "rg/basic_arithmetic"
PARAMS = SMALL_ARITHMETIC
TRAIN_SEED = 1


def refs(seed: int, start: int, n: int) -> list[TaskRef]:
    return [TaskRef(dataset=DATASET, params=PARAMS, seed=seed, index=i)
            for i in range(start, start + n)]


def train_refs(round_: int, tasks: int, held_out: set[str]) -> list[TaskRef]:
    """The round's training problems, never one whose question is in the held-out set."""
    out, index = [], round_ * tasks * 4
    while len(out) < tasks:
        r = refs(TRAIN_SEED, index, 1)[0]
        index += 1
        if get_task(r).prompt not in held_out:
            out.append(r)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=30.0, help="training time budget")
    ap.add_argument("--tasks", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--eval", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=10)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--format-reward", type=float, default=0.0)
    ap.add_argument("--system-prompt", default="direct", help="reasoning-gym SYSTEM_PROMPTS name")
    ap.add_argument("--few-shot", type=int, default=2, help="worked examples before each question")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--section", default="learning (SmolLM2, basic_arithmetic)")
    ap.add_argument("--no-record", action="store_true", help="print only (smoke runs)")
    ap.add_argument("--base-rates", action="store_true",
                    help="only print the held-out greedy accuracy of the untrained model under "
                         "each prompt style of BASE_RATE_STYLES")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    load0 = os.getloadavg()[0]
    model_dir = ensure_builtin(BUILTIN_SMOLLM2)
    if args.base_rates:
        return _base_rates(model_dir, args)
    cfg = Config.model_validate({
        "model": {"device": "cpu"},
        "tasks": {"format_reward": args.format_reward, "system_prompt": args.system_prompt,
                  "few_shot": args.few_shot},
        "trainer": {"learning_rate": args.lr, "local_items": args.tasks, "external_items": 0,
                    "checkpoint_every": 100_000, "max_staleness": 100_000,
                    "micro_batch_size": 8, "seed": 0}})
    eval_refs = refs(EVAL_SEED, 0, args.eval)
    held_out = {get_task(r).prompt for r in eval_refs}
    curve: list[list] = []
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        trainer = Trainer(cfg, model_dir, Path(tmp) / "data", policy_id="learning")
        tok = trainer.tokenizer
        # shares the trainer's model object, like the trainer role's own sampler
        sampler = HFSampler(trainer.model, tok, peer_id="learning", capture_hidden=False)
        params = SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens)
        before = _eval(trainer, sampler, tok, eval_refs, args.max_new_tokens)
        print("before", before, flush=True)
        t_train = time.perf_counter()
        round_ = 0
        while time.perf_counter() - t_train < args.minutes * 60:
            curve.append(_round(trainer, sampler, tok, round_, args, params, held_out))
            print(curve[-1], flush=True)
            round_ += 1
        train_s = time.perf_counter() - t_train
        after = _eval(trainer, sampler, tok, eval_refs, args.max_new_tokens)
        print("after", after, flush=True)
        trainer.close()
    load1 = os.getloadavg()[0]
    if args.no_record:
        return
    _record(args, before, after, curve, train_s, time.perf_counter() - t_start, load0, load1)


# (system prompt, few-shot examples, max new tokens): how the start model does per style
BASE_RATE_STYLES = [("default", 0, 24), ("direct", 0, 16), ("simple", 0, 24),
                    ("chain_of_draft", 0, 24), ("DeepSeekZero", 0, 24), ("direct", 1, 10),
                    ("direct", 2, 10)]


def _base_rates(model_dir, args) -> None:
    from swarm_node.node.models import load_model

    model, tok = load_model(model_dir, device="cpu")
    model.eval()
    sampler = HFSampler(model, tok, capture_hidden=False, max_batch=32)
    eval_refs = refs(EVAL_SEED, 0, args.eval)
    for system, shots, max_new in BASE_RATE_STYLES:
        acc = greedy_accuracy(sampler, tok, eval_refs, max_new, PromptStyle(system, shots))
        print(f"system {system!r}, few_shot {shots}, {max_new} new tokens: "
              + ", ".join(f"{k} {round(v * args.eval)}/{args.eval}" for k, v in acc.items()),
              flush=True)


def _eval(trainer, sampler, tok, eval_refs, max_new):
    trainer.model.eval()
    try:
        return greedy_accuracy(sampler, tok, eval_refs, max_new,
                               PromptStyle.of(trainer.config.tasks))
    finally:
        trainer.model.train()


def _round(trainer, sampler, tok, round_, args, params, held_out) -> list:
    t0 = time.perf_counter()
    style = PromptStyle.of(trainer.config.tasks)
    prompts = [(r, format_prompt(tok, get_task(r, style=style)))
               for r in train_refs(round_, args.tasks, held_out)]
    sampler.version = trainer.version
    trainer.model.eval()
    samples = [s for row in sampler.generate(prompts, args.group, params) for s in row]
    trainer.model.train()
    trainer.add_local(samples)
    stats = trainer.step()
    rewards = [trainer.rescorer.score(s.task, s.text) for s in samples]
    exact = sum(get_task(s.task, style=style).score(s.text) == 1.0 for s in samples)
    return [round_, f"{statistics.mean(rewards):.3f}", sum(r > 0 for r in rewards),
            f"{exact}/{len(samples)}", stats.groups_local, stats.trained,
            f"{stats.loss:.4f}", f"{time.perf_counter() - t0:.0f}"]


def _record(args, before, after, curve, train_s, total_s, load0, load1) -> None:
    metrics = [[k, f"{before[k]:.3f}", f"{after[k]:.3f}", f"{after[k] - before[k]:+.3f}"]
               for k in ("exact", "tagged", "lenient")]
    body = (
        f"SmolLM2-135M-Instruct (builtin:smollm2-135m), CPU, {args.threads} torch threads, "
        f"{DATASET} with params {PARAMS}, reasoning-gym system prompt "
        f"'{args.system_prompt}' (tasks.system_prompt) and {args.few_shot} worked example(s) "
        "of the same generator as an earlier chat turn (tasks.few_shot); one trainer with its "
        "own sampler; "
        "per round "
        f"{args.tasks} training problems x {args.group} completions (temperature 1, at most "
        f"{args.max_new_tokens} new tokens), one GRPO step (lr {args.lr}, AdamW, defaults "
        f"otherwise), reward = {1 - args.format_reward:g} * rg score + {args.format_reward:g} "
        "* tagged (rg's basic_arithmetic score: 1 for an exact answer, a partial credit "
        "of len(answer)/len(text) when the untagged text contains it). Held-out set: "
        f"{args.eval} problems of generator seed {EVAL_SEED}, greedy, at most "
        f"{args.max_new_tokens} new tokens, never trained on. {len(curve)} rounds in "
        f"{train_s:.0f} s of training ({total_s:.0f} s with both evaluations); load average "
        f"(1 min) before/after {load0:.1f}/{load1:.1f} on 2 cores shared with other agents' "
        "jobs. Metrics: exact = the protocol's reward with format_reward 0 is 1; "
        "tagged = has an <answer> tag; lenient = last number in the text equals the answer "
        "(diagnostic only).\n\n"
        + table(["held-out metric", "before", "after", "change"], metrics)
        + "\n\nReward curve (training rounds; `rewarded` = completions with reward > 0, "
        "`exact` = completions with the full reward of an exact answer):\n\n"
        + table(["round", "mean reward", "rewarded", "exact", "groups trained", "stepped",
                 "loss", "seconds"], curve))
    record(args.section, body)


if __name__ == "__main__":
    main()
