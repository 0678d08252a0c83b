"""HF sampler throughput on this machine: tokens/s by model size and batch size, and the cost
of capturing final-norm hidden states (the proof input) as a share of generation time.

Models: the built-in tiny model, and a randomly initialised model with Qwen2.5-0.5B's shape
(24 layers, hidden 896, vocab 151,936; nothing can be downloaded here). Every completion
runs to max_new_tokens (EOS is disabled) so all rows decode the same number of tokens.

    python benchmarks/sampler.py [--quick] [--no-large] [--new-tokens N]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path


def qwen05b_shaped(directory: Path, layers: int = 24) -> Path:
    """Random weights with Qwen2.5-0.5B's shape; the tiny model's tokenizer."""
    import torch
    from swarm_node.node.models import build_tokenizer
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tok = build_tokenizer()
    cfg = Qwen2Config(vocab_size=151_936, hidden_size=896, intermediate_size=4864,
                      num_hidden_layers=layers, num_attention_heads=14, num_key_value_heads=2,
                      max_position_embeddings=4096, tie_word_embeddings=True,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    Qwen2ForCausalLM(cfg).save_pretrained(directory)
    tok.save_pretrained(directory)
    return directory


def run(sampler, prompts, n, params, reps):
    """Best-of-`reps` seconds and tokens for generating n completions per prompt."""
    times, tokens = [], 0
    for r in range(reps):
        seeds = [[1000 * r + 10 * i + j for j in range(n)] for i in range(len(prompts))]
        t0 = time.perf_counter()
        out = sampler.generate(prompts, n, params, seeds=seeds)
        times.append(time.perf_counter() - t0)
        tokens = sum(len(s.completion_ids) for row in out for s in row)
    return min(times), tokens


def bench_model(label, model_dir, batches, new_tokens, reps, threads):
    import torch
    from swarm_node.node.models import load_model
    from swarm_node.node.sampler.hf import HFSampler
    from swarm_node.node.tasks import format_prompt, get_task
    from swarm_node.protocol.messages import SamplingParams, TaskRef

    model, tok = load_model(model_dir)
    n_params = sum(p.numel() for p in model.parameters())
    params = SamplingParams(temperature=1.0, max_new_tokens=new_tokens)
    ref = TaskRef(dataset="toy/digit_successor", seed=0, index=0)
    prompt = (ref, format_prompt(tok, get_task(ref)))
    rows = []
    for b, th in [(b, th) for th in threads for b in batches]:
        torch.set_num_threads(th)
        on = HFSampler(model, tok, capture_hidden=True, max_batch=b)
        off = HFSampler(model, tok, capture_hidden=False, max_batch=b)
        on.eos_ids = off.eos_ids = set()  # decode exactly new_tokens per row
        run(on, [prompt], min(b, 2), params, 1)  # warm-up
        for s in (on, off):
            s.timings = dict.fromkeys(s.timings, 0.0)
        t_on, t_off = [], []
        for _ in range(reps):  # interleave, so load changes hit both alike
            t_on.append(run(on, [prompt], b, params, 1)[0])
            t_off.append(run(off, [prompt], b, params, 1)[0])
        tokens = b * new_tokens
        best_on, best_off = min(t_on), min(t_off)
        diff = 100.0 * (statistics.median(t_on) - statistics.median(t_off)) / \
            statistics.median(t_off)
        # measured inside the sampler: time spent copying/stacking hidden states
        share = 100.0 * on.timings["capture_s"] / on.timings["generate_s"]
        pick = 100.0 * on.timings["pick_s"] / on.timings["generate_s"]
        rows.append([label, f"{n_params / 1e6:.1f}M", th, b, new_tokens, f"{tokens / best_on:.1f}",
                     f"{tokens / best_off:.1f}", f"{share:.2f}%", f"{diff:+.1f}%",
                     f"{pick:.1f}%"])
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="batches 1 and 8, one repetition")
    ap.add_argument("--no-large", action="store_true", help="skip the 0.5B-shaped model")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--large-layers", type=int, default=24)
    ap.add_argument("--threads", default="1,2", help="torch CPU thread counts to try")
    ap.add_argument("--large-batches", default="1,8,32", help="batch sizes for the 0.5B model")
    ap.add_argument("--large-threads", default="1",
                    help="thread counts for the 0.5B-shaped model (2 is very slow when shared)")
    args = ap.parse_args()
    from swarm_node.node.models import build_tiny_model

    batches = [1, 8] if args.quick else [1, 8, 32]
    reps = 1 if args.quick else 3
    threads = [int(t) for t in args.threads.split(",")]
    rows: list[list] = []
    with tempfile.TemporaryDirectory() as tmp:
        tiny = build_tiny_model(Path(tmp) / "tiny", seed=0)
        rows += bench_model("tiny (Qwen2, h64, 2 layers)", tiny, batches, args.new_tokens, reps,
                            threads)
        save(rows, args)  # recorded now, so a slow large model cannot lose these
        if not args.no_large:
            large = qwen05b_shaped(Path(tmp) / "q05", layers=args.large_layers)
            label = f"Qwen2.5-0.5B-shaped, random ({args.large_layers} layers)"
            rows += bench_model(label, large, [int(b) for b in args.large_batches.split(",")],
                                max(8, args.new_tokens // 2),
                                max(1, reps - 1),
                                [int(t) for t in args.large_threads.split(",")])
            save(rows, args)


def save(rows: list[list], args) -> None:
    import torch

    from benchmarks.results import record, table

    body = (
        f"HF sampler (`node/sampler/hf.py`), CPU, torch {torch.__version__}, "
        "torch threads as listed, float32, temperature 1.0, one ~17-token prompt "
        "repeated `batch` times, EOS disabled. tokens/s = generated tokens / wall time "
        "(best of the repetitions, prefill included). `hidden share` = time the sampler spent "
        "copying and stacking final-norm hidden states / total generation time (timed inside "
        "the sampler); `on-off` = median wall time with capture vs without (noisy on a shared "
        "machine); `pick share` = time in seeded Gumbel-max token choice (CPU noise of vocab "
        "size per row and step) / total.\n"
        "The machine is shared with other jobs, so figures are noisy; when cores are "
        "oversubscribed 2 torch threads are much slower than 1 (OpenMP threads spin-wait "
        "on each other).\n\n"
        + table(["model", "params", "threads", "batch", "new tokens", "tok/s (hidden on)",
                 "tok/s (hidden off)", "hidden share", "on-off", "pick share"], rows))
    if args.no_large:
        body += "\n\n(0.5B-shaped model skipped: --no-large)"
    record("sampler", body)


if __name__ == "__main__":
    main()
