"""Scale-out: trainer throughput with 1 vs 2 torch.distributed ranks, and trainer-group
averaging rounds (hivemind) vs model size for 2 and 4 members on loopback.

    python benchmarks/scaleout.py                  # tiny model + SmolLM2 (if installed)
    python benchmarks/scaleout.py --models tiny --steps 3 --sizes 1,8

Throughput: the same buffered groups trained by (a) the plain single-process Trainer with 1
and with 2 torch threads, (b) one torchrun rank, (c) two torchrun ranks (gloo), 1 thread per
rank; one warm-up step, then `--steps` timed steps, no checkpoints during them. Tokens/s is
completion tokens trained / summed step time (rank 0's, which includes the all-reduce).

Averaging: M TrainerGroup handles in this process, each with its own hivemind child process
(as in a trainer), one flat float32 parameter of the given size; all M call `average` at
once. Round time is what the child measures around `DecentralizedAverager.step` (matchmaking
+ all-reduce; target group size M, so the leader starts as soon as all have joined). Bytes: the
p2pd daemons' write_chars (/proc/<pid>/io) over the round, summed over members and divided by
M. p2pd writes both what it sends on TCP and what it hands its Python client from TCP, so this
is about sent + received per member (plus DHT chatter and Noise/TLS framing); butterfly
all-reduce moves 2 (M-1)/M x size each way per member, 4 (M-1)/M x size in all.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.results import record, table

MODELS = {"tiny": "builtin:tiny", "smollm2": "builtin:smollm2-135m"}


def load_avg() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


# throughput -----------------------------------------------------------------------------

def config(model: str, data: Path, groups_per_step: int):
    from swarm_node.node.config import Config

    return Config.model_validate({
        "node": {"data_dir": str(data)},
        "model": {"name": model, "device": "cpu"},
        "trainer": {"local_items": groups_per_step, "external_items": 0, "max_staleness": 1000,
                    "micro_batch_size": 4, "checkpoint_every": 1000, "keep_checkpoints": 2}})


def fill(cfg, n_groups: int) -> None:
    """Buffered groups of 4 completions (two right, two wrong answers) on toy tasks."""
    from swarm_node.node.sampler.base import Sample
    from swarm_node.node.tasks import format_prompt, get_task
    from swarm_node.node.trainer.distributed import model_dir_of
    from swarm_node.node.trainer.trainer import Trainer
    from swarm_node.protocol.messages import TaskRef

    t = Trainer(cfg, model_dir_of(cfg), cfg.data_dir, policy_id="bench")
    tok = t.tokenizer
    for i in range(n_groups):
        ref = TaskRef(dataset="toy/digit_successor", params={}, seed=7, index=i)
        task = get_task(ref)
        prompt = format_prompt(tok, task)
        texts = [task.answer + " because the next digit follows", "no idea at all, sorry"] * 2
        samples = []
        for j, text in enumerate(texts):
            ids = list(tok.encode(text, add_special_tokens=False)) + [tok.eos_token_id]
            samples.append(Sample(task=ref, prompt_ids=prompt, completion_ids=ids,
                                  logprobs=torch.full((len(ids),), -2.0), finish_reason="eos",
                                  seed=j, text=text, hidden=None, policy_version=0))
        t.add_local(samples)
    t.close()


def plain(cfg, steps: int, threads: int) -> tuple[int, float]:
    """The plain Trainer in this process; the first (warm-up) step is not counted."""
    from swarm_node.node.trainer.distributed import model_dir_of
    from swarm_node.node.trainer.trainer import Trainer

    torch.set_num_threads(threads)
    t = Trainer(cfg, model_dir_of(cfg), cfg.data_dir, policy_id="bench")
    tokens = seconds = 0.0
    try:
        for i in range(steps + 1):
            s = t.step()
            if i > 0:
                tokens, seconds = tokens + s.tokens, seconds + s.seconds
    finally:
        t.close()
    return int(tokens), seconds


def ranks(cfg, procs: int, steps: int, threads: int, workdir: Path) -> tuple[int, float]:
    """torchrun ranks (`threads` torch threads each); the warm-up step is not counted."""
    path = workdir / f"ranks-{procs}.toml"
    path.write_text(cfg.to_toml())
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         f"--nproc-per-node={procs}", "-m", "swarm_node.node.ranks", "--config", str(path),
         "--offline-steps", str(steps + 1)],
        capture_output=True, text=True, timeout=3600, check=False,
        env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    if out.returncode != 0:
        raise SystemExit(f"torchrun failed:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
    lines = [json.loads(x) for x in out.stdout.splitlines() if x.startswith('{"version"')][1:]
    return sum(x["tokens"] for x in lines), sum(x["seconds"] for x in lines)


RUNS = (("plain Trainer, 1 process", 0, 1), ("plain Trainer, 1 process", 0, 2),
        ("torchrun, 1 rank", 1, 1), ("torchrun, 2 ranks (gloo)", 2, 1))


def throughput(model_key: str, steps: int, groups_per_step: int, workdir: Path) -> list:
    model = MODELS[model_key]
    base = workdir / f"tp-{model_key}-base"
    fill(config(model, base, groups_per_step), groups_per_step * (steps + 1))
    rows = []
    for label, procs, threads in RUNS:
        data = workdir / f"tp-{model_key}-{procs}-{threads}"
        shutil.copytree(base, data)
        cfg = config(model, data, groups_per_step)
        before = load_avg()
        tokens, seconds = (plain(cfg, steps, threads) if procs == 0
                           else ranks(cfg, procs, steps, threads, workdir))
        rows.append([model_key, label, threads, steps, groups_per_step * 4, tokens,
                     round(seconds, 2), round(tokens / seconds, 1),
                     f"{before} -> {load_avg()}"])
        print(rows[-1], flush=True)
        shutil.rmtree(data, ignore_errors=True)
    return rows


# averaging ------------------------------------------------------------------------------

class Blob(torch.nn.Module):
    def __init__(self, numel: int, seed: int):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.w = torch.nn.Parameter(torch.randn(numel, generator=g))


def daemon_written(group) -> int:
    total = 0
    for p in psutil.Process(group.proc.pid).children(recursive=True):
        try:
            if p.name() == "p2pd":
                total += p.io_counters().write_chars
        except (psutil.Error, AttributeError):
            pass
    return total


def averaging(members: int, numel: int, rounds: int, workdir: Path) -> list:
    from swarm_node.node.trainer.group import TrainerGroup, write_group_key

    key_path = workdir / f"k-{members}-{numel}"
    write_group_key(key_path)
    key = bytes.fromhex(key_path.read_text().strip())
    groups, blobs = [], []
    try:
        peers: list[str] = []
        for i in range(members):
            blob = Blob(numel, seed=i)
            g = TrainerGroup(blob, name="bench", key=key, every=1, timeout_s=120.0,
                             initial_peers=peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                             state_dir=workdir / f"g-{members}-{numel}-{i}", matchmaking_s=2.0,
                             target_size=members)
            peers = peers or g.maddrs
            groups.append(g)
            blobs.append(blob)
        rows = []
        for r in range(rounds):
            replies: list = [None] * members
            written = [daemon_written(g) for g in groups]
            before = load_avg()

            def run(i, r=r, replies=replies):
                replies[i] = groups[i].average(r + 1)

            threads = [threading.Thread(target=run, args=(i,)) for i in range(members)]
            t0 = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            wall = time.perf_counter() - t0
            moved = sum(daemon_written(g) - w for g, w in zip(groups, written)) / members
            ok = all(x.get("ok") for x in replies)
            same = all(torch.allclose(b.w, blobs[0].w, atol=1e-6) for b in blobs)
            rows.append([members, numel * 4 / 2**20, r + 1, ok and same,
                         round(statistics.median(x.get("seconds", 0) for x in replies), 2),
                         round(wall, 2), round(moved / 2**20, 1),
                         round(4 * (members - 1) / members * numel * 4 / 2**20, 1),
                         f"{before} -> {load_avg()}"])
            print(rows[-1], flush=True)
        return rows
    finally:
        for g in groups:
            g.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="tiny,smollm2")
    ap.add_argument("--steps", default="tiny=8,smollm2=3",
                    help="timed steps per model (after one warm-up step)")
    ap.add_argument("--groups-per-step", type=int, default=4)
    ap.add_argument("--sizes", default="1,8,32", help="averaged parameters, Mi floats")
    ap.add_argument("--members", default="2,4")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="scaleout-"))
    start_load = load_avg()
    try:
        tp = []
        steps = {k: int(v) for k, v in (x.split("=") for x in args.steps.split(","))}
        for m in args.models.split(","):
            if m:
                tp += throughput(m, steps.get(m, 3), args.groups_per_step, workdir)
        av = []
        for members in map(int, args.members.split(",")):
            for size in map(float, args.sizes.split(",")):
                av += averaging(members, int(size * 2**20), args.rounds, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    body = f"""Load average (1/5/15 min) at start: {start_load}; per row below. The machine is
shared (2 cores, several agents): on 2 busy cores 2 ranks cannot run twice as fast, and the
figures say so rather than show the scaling a quiet multi-core or multi-GPU machine gives.

### Trainer throughput: plain trainer vs torchrun ranks (CPU, gloo)

{table(["model", "trainer", "torch threads / process", "timed steps", "completions/step",
        "tokens", "step s (sum)", "tokens/s", "load before -> after"], tp)}

### Trainer-group averaging rounds (hivemind, loopback)

{table(["members", "MiB averaged", "round", "ok and identical", "round s (median)",
        "wall s", "MiB through p2pd per member", "4(M-1)/M x size MiB", "load"], av)}
"""
    print(body)
    if not args.no_record:
        record("scale-out (torch.distributed ranks, trainer groups)", body)


if __name__ == "__main__":
    main()
