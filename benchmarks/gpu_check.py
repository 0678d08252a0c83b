"""The GPU check of issue #12, one command on a CUDA machine (never run yet: no GPU was lent):

    python -m benchmarks.gpu_check [--model builtin:smollm2-135m] [--out gpu_check.json]

1. Noise, CPU vs CUDA: protocol/noise.py's mantissas (must be bit-identical), the float32
   Gumbel values (bit-identical except, at most, an ulp from the logarithms: counted), and
   noisy_argmax's choices over random scores (pruned and full), for the model's vocabulary
   and Qwen2.5's (151,936); plus the known-answer vectors tests/vectors/noise.json on CUDA.
2. Sampler speed on CUDA: HFSampler vs VLLMSampler (when vllm is importable) tokens/s at
   batch 8, 32 and 128, the same prompts, seeds and max tokens, natural EOS, best of 2; and
   vLLM's own (not replayable) sampler on the same engine: what the seeded hook costs.
3. Honest acceptance across the samplers and devices: fp32 rollouts of each sampler on CUDA,
   checked by the fp32 verifier on CUDA and on the CPU: accepted / rejected with reasons.
   (bf16 is not covered: it needs a second pair of samplers in bf16.)

Everything found is printed and written to --out as JSON; a missing part (no vllm, no
SmolLM2 package) is reported as skipped with the reason, never as a pass. `--model random`
uses random weights of Qwen2.5-0.5B's shape (nothing to install; speed and noise only mean
something there, its text is noise). Needs the project importable (`pip install -e .`, or
run from the repository root: a `swarm_node` namespace over the folders is made on the fly)
and its dependencies (pydantic, msgpack, blake3, reasoning-gym, ...).

Where it can run: on a CUDA machine with the project and vllm installed, all of it. On the
H200 lent by this workplace's device tool (torch 2.11 + CUDA, no vllm, no pydantic / blake3 /
reasoning-gym, 64 MiB carried per call) the CUDA vllm wheel (~336 MB) and the SmolLM2 GGUF
(93 MB) cannot travel: there only part 1 and the HF half of parts 2-3 can run, with
`--model random` and the missing pure-Python wheels carried.
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


def speed(samplers: dict, tok, batches: list[int], new_tokens: int, device: str) -> list[dict]:

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
                out = s.generate(prompts, n, params, seeds=seeds)
                sync(device)
                best = min(best, time.perf_counter() - t0)
            ids[name] = [x.completion_ids for r in out for x in r]
            tokens = sum(map(len, ids[name]))
            row[name] = {"tokens": tokens, "tok_per_s": round(tokens / best, 1)}
        if len(ids) == 2:
            a, c = ids.values()
            row["identical_completions"] = sum(x == y for x, y in zip(a, c))
            row["vllm_native"] = native_speed(samplers["vllm"], prompts, n, params, device)
        rows.append(row)
        print(json.dumps(row), flush=True)
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


def acceptance(samplers: dict, model_dir: str, tok, batch: int, new_tokens: int,
               device: str) -> dict:
    """Each sampler's rollouts (fp32 on `device`) checked by the fp32 verifier there and on
    the CPU."""
    from swarm_node.node.models import load_model
    from swarm_node.node.testing.attacks import make_batch
    from swarm_node.verifier.checks import RolloutVerifier

    sender = "gpu-check"
    source, tasks, prompts, n, params = workload(tok, batch, new_tokens, sender)
    batches = {}
    for name, s in samplers.items():
        s.peer_id, s.version = sender, 0  # default seeds: what the verifier expects
        out = [x for r in s.generate(prompts, n, params) for x in r]
        batches[name] = make_batch([t for t in tasks for _ in range(n)], out,
                                   swarm_id="default", round_=0, policy_id="trainer",
                                   policy_version=0, params=params)
    result = {}
    dtype = "float32"
    for where in (device, "cpu"):
        model, vtok = load_model(model_dir, dtype=dtype, device=where)
        for name, rollouts in batches.items():
            # a verifier per batch: both batches are the sender's round 0, and one verifier
            # rejects a second batch of a used round as `round_reused`
            verifier = RolloutVerifier(model, vtok, source, swarm_id="default",
                                       latest_version=lambda: 0, dtype=dtype)
            res = verifier.verify(rollouts, sender)
            reasons: dict[str, int] = {}
            for r in res:
                reasons[r.reason] = reasons.get(r.reason, 0) + 1
            result[f"{name} sampled fp32/{device}, verified {dtype}/{where}"] = reasons
            print(name, dtype, where, reasons, flush=True)
        del model, verifier
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="builtin:smollm2-135m",
                    help="a model folder, a builtin name, or 'random' (0.5B-shaped)")
    ap.add_argument("--batches", default="8,32,128")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--check-batch", type=int, default=32,
                    help="completions per sampler checked by the verifier")
    ap.add_argument("--out", default="gpu_check.json")
    ap.add_argument("--device", default="cuda",
                    help="'cpu' only to smoke-test this script (it then compares the CPU "
                         "with itself)")
    args = ap.parse_args()
    importable_project()
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("gpu_check: no CUDA device visible to torch")
    report: dict = {"torch": torch.__version__, "device": torch.cuda.get_device_name(0)
                    if args.device == "cuda" else args.device}
    report["noise"] = check_noise([49_152, 151_936], args.device)
    print(json.dumps(report["noise"]), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            model_dir, label = resolve_model(args.model, Path(tmp))
        except Exception as e:  # noqa: BLE001 - reported, the noise part stands on its own
            report["skipped"] = f"model {args.model}: {type(e).__name__}: {e}"
            return write(report, args.out)
        report["model"] = label
        samplers = make_samplers(model_dir, report, args.device)
        try:
            tok = next(iter(samplers.values())).tokenizer
            report["speed"] = speed(samplers, tok, [int(b) for b in args.batches.split(",")],
                                    args.new_tokens, args.device)
            report["acceptance"] = acceptance(samplers, model_dir, tok, args.check_batch,
                                              min(32, args.new_tokens), args.device)
        finally:
            for s in samplers.values():
                s.close()
    write(report, args.out)


def make_samplers(model_dir: str, report: dict, device: str) -> dict:
    from swarm_node.node.models import load_model
    from swarm_node.node.sampler.hf import HFSampler

    model, tok = load_model(model_dir, device=device)
    samplers = {"hf": HFSampler(model, tok, max_batch=256)}
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


def write(report: dict, path: str) -> None:
    text = json.dumps(report, indent=1)
    Path(os.path.expanduser(path)).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
