"""The choice that is left (issue #30 item 12): what a sender gains by choosing which of its
draws to send, measured on SmolLM2 with the demo's swarm settings.

    .venv/bin/python benchmarks/verifier_choice.py --senders 4 --draws 10 [--no-record]

A sender may hold draws for every version the trainer still accepts (max_staleness + 1 = 5)
times its rounds per version (2): 10 draws, each `tasks_per_round` tasks x
`completions_per_task` seeded completions that it cannot change, only send or withhold.
Per sender this samples 10 real draws (SmolLM2, the demo's one-digit arithmetic, the same
policy for all: an upper bound on the choice, as real draws of older versions are no
better), scores them as the trainer does, and compares what a chooser sends (its best draw
by mean reward, or by the number of groups with a training signal: not all rewards equal)
with an honest sender's draw (any one), and what choosing costs it (it sends 1 of 10
draws: a tenth of the accepted work, reputation and influence of sending them all).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def run(senders: int, draws: int) -> list[list[dict]]:
    import torch
    from swarm_node.node.config import Config
    from swarm_node.node.demo import smollm2_settings
    from swarm_node.node.models import BUILTIN_SMOLLM2, ensure_builtin, load_model
    from swarm_node.node.sampler.factory import sampling_params
    from swarm_node.node.sampler.hf import HFSampler
    from swarm_node.node.sampler.rounds import sample_round
    from swarm_node.node.tasks import PromptStyle, TaskSource, get_task

    torch.set_num_threads(1)
    cfg = Config.model_validate(smollm2_settings({"trainer": {}}))
    model, tokenizer = load_model(ensure_builtin(BUILTIN_SMOLLM2))
    source = TaskSource.of(cfg.tasks, "default")
    style = PromptStyle.of(cfg.tasks)
    params = sampling_params(cfg)
    out = []
    for s in range(senders):
        peer = f"12D3KooWChooser{s}"
        sampler = HFSampler(model, tokenizer, peer_id=peer, version=0)
        rows = []
        for r in range(draws):
            t0 = time.monotonic()
            samples = sample_round(sampler, tokenizer, source, peer, r,
                                   cfg.tasks.tasks_per_round,
                                   cfg.sampler.completions_per_task, params, style=style)
            by_task: dict[str, list[float]] = {}
            for x in samples:
                reward = get_task(x.task, style=style).score(x.text)
                by_task.setdefault(x.task.model_dump_json(), []).append(reward)
            rewards = [v for g in by_task.values() for v in g]
            rows.append({"mean": sum(rewards) / len(rewards),
                         "signal_groups": sum(1 for g in by_task.values() if len(set(g)) > 1),
                         "groups": len(by_task), "seconds": time.monotonic() - t0})
            print(f"sender {s} draw {r}: {rows[-1]}", flush=True)
        out.append(rows)
    return out


def report(res: list[list[dict]], load: str) -> str:
    from benchmarks.results import table

    def stat(key: str, pick) -> float:
        return statistics.mean(pick([d[key] for d in rows]) for rows in res)

    rows = []
    for key, what in (("mean", "mean reward of the batch sent"),
                      ("signal_groups", "task groups with a training signal")):
        honest = stat(key, statistics.mean)
        best = stat(key, max)
        rows.append([what, f"{honest:.3f}", f"{best:.3f}", f"{best - honest:+.3f}"])
    n = len(res[0])
    spread = [statistics.pstdev(d["mean"] for d in r) for r in res]
    return "\n".join([
        (f"Load average: {load}. SmolLM2-135M (fp32, CPU), the demo's swarm settings "
        f"(rg/basic_arithmetic one digit, `direct` prompt, 2 few-shot, 2 tasks x 8 "
        f"completions, 10 new tokens, T = 1). {len(res)} senders x {n} draws each.\n"),
        table(["what the sender sends", "honest (any one draw, mean over draws)",
               f"chooser (best of {n})", "gain"], rows),
        "",
        (f"- spread of a draw's mean reward within a sender: "
        f"{statistics.mean(spread):.3f} (sd); the chooser's gain is about "
        f"{1.54:.2f} sd for 10 draws (the expected maximum of 10 normal draws)."),
        (f"- cost of choosing: the chooser sends 1 draw in {n}: {1 / n:.0%} of the accepted "
        "work, reputation and share of the trainer's batches that sending every draw brings."),
    ])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--senders", type=int, default=4)
    ap.add_argument("--draws", type=int, default=10)
    ap.add_argument("--no-record", action="store_true")
    ap.add_argument("--out", default="/tmp/verifier-choice.json")
    ap.add_argument("--report-from", metavar="JSON", help="report a saved run (--out)")
    ap.add_argument("--load", default="", help="with --report-from: the run's load average")
    args = ap.parse_args()
    if args.report_from:
        res, load = json.loads(Path(args.report_from).read_text()), args.load
    else:
        load = " / ".join(f"{x:.1f}" for x in os.getloadavg())
        res = run(args.senders, args.draws)
        Path(args.out).write_text(json.dumps(res))
        load += " -> " + " / ".join(f"{x:.1f}" for x in os.getloadavg())
    text = report(res, load)
    print(text)
    if not args.no_record:
        from benchmarks.results import record

        record("verifier-choice", text)


if __name__ == "__main__":
    main()
