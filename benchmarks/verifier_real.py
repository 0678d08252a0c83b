"""The verifier on the real model (SmolLM2-135M-Instruct), fp32 and bf16: honest calibration,
per-peer sequential tests, cost. Driven by `benchmarks/verifier.py --real ...`.

    # collect (one process per dtype; each appends one JSON line per verified completion)
    .venv/bin/python benchmarks/verifier.py --real float32 --real-budget-s 1200
    .venv/bin/python benchmarks/verifier.py --real bfloat16 --real-budget-s 1800
    # cost: generation vs the baseline commit's verifier vs today's, same batches
    .venv/bin/python benchmarks/verifier.py --real-cost float32 --real-cost-batches 3
    # report into RESULTS.md section "verifier-real" (with the bootstrap of the per-peer
    # tests: >= 10,000 resampled honest batches per dtype, and the attacks' detection delays)
    .venv/bin/python benchmarks/verifier.py --real-report LOAD

Every completion is verified with loose thresholds (so nothing stops early) and its
statistics are kept; the report then says, per statistic, the worst honest value against
the threshold of `CheckSettings.for_dtype(dtype)`, and how many honest completions those
thresholds would have rejected.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import torch

OUT = Path(os.environ.get("VERIFIER_REAL_OUT", "/tmp/verifier-real"))
MIX = {"toy/digit_successor": 1.0, "toy/digit_copy": 1.0, "rg/basic_arithmetic": 1.0}
SENDER = "12D3KooWBenchRealPeer"


def variations(dtype: str):
    """(name, threads, sampler max_batch, tasks, n, temperature, top_p, max_new_tokens).
    bf16 runs at a few tokens per second on this CPU (no bf16 units): short completions in
    large batches give the most honest completions per minute (and the proof's noisiest
    case, chunks of few tokens); one long and one batch-1 variation keep those cases."""
    if dtype == "float32":
        return [("batch 8 (2 tasks x 4), 1 thread", 1, 8, 2, 4, 1.0, 1.0, 32),
                ("batch 1 (no padding), 1 thread", 1, 1, 1, 2, 1.0, 1.0, 32),
                ("batch 8, 2 threads", 2, 8, 2, 4, 1.0, 1.0, 32),
                ("batch 8, T=0.7 top-p 0.9", 1, 8, 2, 4, 0.7, 0.9, 32),
                ("batch 8 (1 task x 8), long: 96 tokens", 1, 8, 1, 8, 1.0, 1.0, 96),
                ("batch 32 (4 tasks x 8), 1 thread", 1, 32, 4, 8, 1.0, 1.0, 32)]
    return [("batch 32 (4 tasks x 8), 1 thread, 8 tokens", 1, 32, 4, 8, 1.0, 1.0, 8),
            ("batch 32, 2 threads, 8 tokens", 2, 32, 4, 8, 1.0, 1.0, 8),
            ("batch 32, T=0.7 top-p 0.9, 8 tokens", 1, 32, 4, 8, 0.7, 0.9, 8),
            ("batch 8 (2 tasks x 4), 1 thread, 32 tokens", 1, 8, 2, 4, 1.0, 1.0, 32),
            ("batch 1 (no padding), 1 thread, 8 tokens", 1, 1, 1, 2, 1.0, 1.0, 8),
            ("batch 8 (1 task x 8), long: 64 tokens", 1, 8, 1, 8, 1.0, 1.0, 64)]


def loose_settings():
    """Thresholds loose enough that honest completions keep all their statistics. top_p_eps
    0.09 keeps top-p 0.9 runs truncated (at 0.99), so their shape z is still measured
    against a truncated distribution; a top-p excess beyond it rejects, with the detail."""
    from swarm_node.verifier.checks import CheckSettings
    from swarm_node.verifier.proof import ProofThresholds

    return CheckSettings(max_policy_lag=1 << 30, logprob_tol=50.0, tie_eps=1.0,
                         replay_outlier_eps=50.0, top_p_eps=0.09,
                         min_eos_prob=0.0, shape_z_max=1e9,
                         proof=ProofThresholds(match_rel=1.0, max_mismatches=128,
                                               max_mean_abs=10.0, max_bias=10.0))


def collect(dtype: str, budget_s: float) -> Path:
    """Sample and verify honest rounds for each variation, splitting `budget_s` evenly."""
    from swarm_node.node.models import BUILTIN_SMOLLM2, ensure_builtin, load_model
    from swarm_node.node.tasks import TaskSource
    from swarm_node.node.testing import attacks
    from swarm_node.protocol.messages import SamplingParams
    from swarm_node.verifier.checks import RolloutVerifier

    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / f"{dtype}.jsonl"
    model, tokenizer = load_model(ensure_builtin(BUILTIN_SMOLLM2), dtype=dtype)
    source = TaskSource(MIX, "default")
    only = [w for w in os.environ.get("VERIFIER_REAL_ONLY", "").split(",") if w]
    specs = [v for v in variations(dtype) if not only or any(w in v[0] for w in only)]
    per = budget_s / len(specs)
    # fresh tasks in every run (runs append to one file); VERIFIER_REAL_ROUND replays a round
    round_ = int(os.environ.get("VERIFIER_REAL_ROUND", "0")) or int(time.time())
    with open(path, "a") as out:
        for name, threads, max_batch, tasks, n, temp, top_p, max_new in specs:
            torch.set_num_threads(threads)
            params = SamplingParams(temperature=temp, top_p=top_p, max_new_tokens=max_new)
            t_end = time.monotonic() + per
            v = RolloutVerifier(model, tokenizer, source, swarm_id="default",
                                latest_version=lambda: 0, dtype=dtype,
                                settings=loose_settings())
            while time.monotonic() < t_end:
                t0, c0 = time.perf_counter(), time.process_time()
                batch = attacks.sample_batch(model, tokenizer, source, SENDER, round_=round_,
                                             version=0, tasks=tasks, n=n, params=params,
                                             max_batch=max_batch)
                gen_s, gen_cpu = time.perf_counter() - t0, time.process_time() - c0
                batch = batch.model_copy(update={"dtype": dtype})
                t0, c0 = time.perf_counter(), time.process_time()
                results = v.verify(batch, SENDER)
                verify_s, verify_cpu = time.perf_counter() - t0, time.process_time() - c0
                tokens = sum(c.completion_ids.shape[0] for c in batch.completions)
                out.writelines(json.dumps({
                    "dtype": dtype, "variation": name, "round": round_,
                    "reason": r.reason, "detail": r.detail, "stats": r.stats,
                    "tokens": tokens,
                    "len": c.completion_ids.shape[0], "finish": c.finish_reason,
                    "gen_s": gen_s, "verify_s": verify_s, "gen_cpu": gen_cpu,
                    "verify_cpu": verify_cpu,
                    "completions": len(batch.completions)}) + "\n"
                    for r, c in zip(results, batch.completions))
                out.flush()
                round_ += 1
                print(f"{dtype} {name}: round {round_}, gen {gen_s:.1f}s verify {verify_s:.1f}s",
                      flush=True)
    return path


# cost: before / after on the same batches ----------------------------------------------------

COST_OUT = OUT / "cost.jsonl"
SPOT_FRACTION = 0.1  # an example spot-check fraction for trusted peers


def cost_variations(dtype: str):
    """(name, threads, max_batch, tasks, n, temperature, top_p, max_new_tokens)."""
    rows = [("batch 8 (2 tasks x 4), 1 thread", 1, 8, 2, 4, 1.0, 1.0, 32),
            ("batch 8, T=0.7 top-p 0.9", 1, 8, 2, 4, 0.7, 0.9, 32),
            ("batch 8, 2 threads", 2, 8, 2, 4, 1.0, 1.0, 32),
            ("batch 32 (4 tasks x 8), 1 thread", 1, 32, 4, 8, 1.0, 1.0, 32)]
    return rows if dtype == "float32" else rows[:1]


def verifier_at(commit: str):
    """RolloutVerifier of verifier/checks.py as of `commit` (the baseline of the cost table),
    loaded as a module of this package so its relative imports resolve."""
    import importlib.util
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent

    def load(path: str, name: str, replace: tuple[str, str] = ("", "")):
        src = subprocess.run(["git", "show", f"{commit}:{path}"], cwd=root, text=True,
                             capture_output=True, check=True).stdout
        if replace[0]:
            src = src.replace(*replace)
        mod = importlib.util.module_from_spec(importlib.util.spec_from_loader(name, loader=None))
        mod.__package__ = "swarm_node.verifier"
        sys.modules[name] = mod
        exec(compile(src, f"{commit}:{path}", "exec"), mod.__dict__)  # noqa: S102
        return mod

    tag = commit[:10]
    has_prefill = subprocess.run(["git", "cat-file", "-e", f"{commit}:verifier/prefill.py"],
                                 check=False, cwd=root, capture_output=True).returncode == 0
    # the baseline's own prefill.py too (its prompt pass and padding are part of the cost)
    if has_prefill:
        load("verifier/prefill.py", f"swarm_node.verifier._prefill_{tag}")
    mod = load("verifier/checks.py", f"swarm_node.verifier._checks_{tag}",
               ("from .prefill import", f"from ._prefill_{tag} import") if has_prefill
               else ("", ""))
    return mod.RolloutVerifier


def cost(dtype: str, batches: int, baseline: str) -> Path:
    """Per variation, `batches` honest batches: generation time (HFSampler), then on the
    same batch the baseline verifier, today's verifier (one instance per variation, as the
    trainer keeps one per policy: its prompt cache is warm after the first batch, which
    counts too) and the cheap checks alone (a spot check that skips every group)."""
    from swarm_node.node.models import BUILTIN_SMOLLM2, ensure_builtin, load_model
    from swarm_node.node.tasks import TaskSource
    from swarm_node.node.testing import attacks
    from swarm_node.protocol.messages import SamplingParams
    from swarm_node.verifier.checks import RolloutVerifier

    before_cls = verifier_at(baseline)
    model, tokenizer = load_model(ensure_builtin(BUILTIN_SMOLLM2), dtype=dtype)
    source = TaskSource(MIX, "default")
    OUT.mkdir(parents=True, exist_ok=True)

    def make(cls):
        return cls(model, tokenizer, source, swarm_id="default", latest_version=lambda: 0,
                   dtype=dtype)

    round_ = 10_000 + int(time.time()) % 1_000_000  # fresh tasks in every run
    per_token, per_row = linear_flops(model)
    with open(COST_OUT, "a") as out:
        for name, threads, max_batch, tasks, n, temp, top_p, max_new in cost_variations(dtype):
            torch.set_num_threads(threads)
            peak = gemm_peak(model, dtype)
            params = SamplingParams(temperature=temp, top_p=top_p, max_new_tokens=max_new)
            after, cheap = make(RolloutVerifier), make(RolloutVerifier)
            for k in range(batches):
                t0, c0 = time.perf_counter(), time.process_time()
                batch = attacks.sample_batch(model, tokenizer, source, SENDER, round_=round_,
                                             version=0, tasks=tasks, n=n, params=params,
                                             max_batch=max_batch)
                rec = {"dtype": dtype, "variation": name, "gen_s": time.perf_counter() - t0,
                       "gen_cpu": time.process_time() - c0,
                       "tokens": sum(c.completion_ids.shape[0] for c in batch.completions)}
                batch = batch.model_copy(update={"dtype": dtype})
                comps = batch.completions
                prompt_tokens = sum(c.prompt_ids.shape[0] for c in comps)
                group_prompts = sum(c.prompt_ids.shape[0] for c in
                                    {bytes(c.prompt_ids.data): c for c in comps}.values())
                saved_before = after.prompt_cache.tokens_saved
                # linear-layer FLOPs (attention scores left out: short sequences): the
                # sampler feeds every row's prompt and completion, and the LM head once per
                # token; the verifier feeds each group's prompt once (less the cached
                # prefix) and the completions but their last token, the LM head at every
                # completion token
                rec["gen_gflop"] = (per_token * (prompt_tokens + rec["tokens"])
                                    + per_row * rec["tokens"]) / 1e9
                rec["k"] = k  # 0: the verifier's prompt cache is cold
                for key, v, spot in (("before", make(before_cls), None),
                                     ("after", after, None),
                                     ("cheap", cheap, lambda ids: False)):
                    t0, c0 = time.perf_counter(), time.process_time()
                    results = v.verify(batch, SENDER, spot_check=spot)
                    rec[f"{key}_s"] = time.perf_counter() - t0
                    rec[f"{key}_cpu"] = time.process_time() - c0
                    rec[f"{key}_reasons"] = sorted({r.reason for r in results})
                rec["prompt_tokens_saved"] = after.prompt_cache.tokens_saved
                fed = (group_prompts - (after.prompt_cache.tokens_saved - saved_before)
                       + rec["tokens"] - len(comps))
                rec["verify_gflop"] = (per_token * fed + per_row * rec["tokens"]) / 1e9
                # the least CPU time the verifier's linear layers can take: its FLOPs at the
                # GEMM rates measured on the model's own weights in this process
                rec["floor_cpu"] = (per_token * fed / peak[0]
                                    + per_row * rec["tokens"] / peak[1]) / 1e9
                rec["peak_gflops"] = peak
                out.write(json.dumps(rec) + "\n")
                out.flush()
                round_ += 1
                print(f"{name}: cpu s: gen {rec['gen_cpu']:.1f} before {rec['before_cpu']:.2f} "
                      f"after {rec['after_cpu']:.2f} cheap {rec['cheap_cpu']:.3f}; wall gen "
                      f"{rec['gen_s']:.1f}", flush=True)
    return COST_OUT


def gemm_peak(model, dtype: str, rows: int = 256) -> tuple[float, float]:
    """GFLOP per CPU second of one layer's linear maps (the decoder's weights, `rows` rows:
    the verifier's shape; more rows run no faster here) and of the LM head, best of 3."""
    layer = model.get_decoder().layers[0]
    mats = [m.weight for m in layer.modules() if isinstance(m, torch.nn.Linear)]
    head = model.get_output_embeddings().weight

    def rate(weights):
        x = {w.shape[1]: torch.randn(rows, w.shape[1], dtype=w.dtype) for w in weights}
        flops = sum(2.0 * rows * w.shape[0] * w.shape[1] for w in weights)
        best = math.inf
        with torch.inference_mode():
            for _ in range(4):  # the first warms up
                c0 = time.process_time()
                for w in weights:
                    torch.nn.functional.linear(x[w.shape[1]], w)
                best = min(best, time.process_time() - c0) if _ else best
        return flops / best / 1e9

    return rate(mats * 4), rate([head])


def linear_flops(model) -> tuple[float, float]:
    """(FLOPs of the decoder's linear layers per token fed, of the LM head per row)."""
    c = model.config
    h, inter = c.hidden_size, c.intermediate_size
    kv = h // c.num_attention_heads * getattr(c, "num_key_value_heads", c.num_attention_heads)
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * inter
    return 2.0 * c.num_hidden_layers * per_layer, 2.0 * h * c.vocab_size


def cost_table() -> list[list]:
    """Per variation: verify / generate in CPU seconds of the process (what the work costs;
    wall time on this shared machine mostly measures the other tenants) and in wall time;
    "warm" leaves out each variation's first batch (the verifier's prompt cache is cold
    there; a trainer keeps one verifier per policy, so warm is its steady state); GFLOP per
    CPU second of the linear layers, for generation and verification."""
    if not COST_OUT.exists():
        return []
    by: dict[str, dict] = {}
    for line in COST_OUT.read_text().splitlines():
        r = json.loads(line)
        for part in ("all", "warm") if r.get("k", 0) > 0 else ("all",):
            d = by.setdefault(f"{r['dtype']} {r['variation']}", {}).setdefault(
                part, {"n": 0, "tok": 0, "bad": set()})
            d["n"] += 1
            d["tok"] += r["tokens"]
            for k in ("gen", "before", "after", "cheap"):
                for unit in ("cpu", "s"):
                    d[f"{k}_{unit}"] = d.get(f"{k}_{unit}", 0.0) + r[f"{k}_{unit}"]
            for k in ("gen_gflop", "verify_gflop", "floor_cpu"):
                d[k] = d.get(k, 0.0) + r.get(k, float("nan"))
            d["bad"] |= {x for x in r["before_reasons"] + r["after_reasons"] if x != "ok"}
    rows = []
    for k, parts in by.items():
        d, w = parts["all"], parts.get("warm")
        full, cheap = d["after_cpu"] / d["gen_cpu"], d["cheap_cpu"] / d["gen_cpu"]
        warm = w["after_cpu"] / w["gen_cpu"] if w else float("nan")
        rows.append([k, d["n"], d["tok"], f"{d['tok'] / d['gen_cpu']:.1f}",
                     f"{d['before_cpu'] / d['gen_cpu']:.1%}", f"**{full:.1%}**",
                     f"**{warm:.1%}** ({w['n'] if w else 0})",
                     f"{d['before_s'] / d['gen_s']:.0%} / {d['after_s'] / d['gen_s']:.0%}",
                     f"{cheap:.2%}",
                     f"{SPOT_FRACTION * full + (1 - SPOT_FRACTION) * cheap:.2%}",
                     (f"{d['gen_gflop'] / d['gen_cpu']:.1f} / "
                      f"{d['verify_gflop'] / d['after_cpu']:.1f}"),
                     f"{d['floor_cpu'] / d['gen_cpu']:.1%}".replace("nan%", "-"),
                     ", ".join(sorted(d["bad"])) or "none"])
    return rows


COST_HEADER = ["dtype, variation", "batches", "tokens", "gen tok/CPU-s",
               "verify / generate, baseline (CPU)", "verify / generate, now (CPU)",
               "now, warm prompt cache (batches)", "wall: baseline / now",
               "cheap checks only (CPU)", f"amortised, spot checks at {SPOT_FRACTION:.0%}",
               "linear-layer GFLOP per CPU-s: generate / verify",
               "floor: verifier's linear layers at the measured GEMM peak / generate",
               "rejects"]


# honest flip errors: what an honest sampler's floats do to the verifier's top two ---------

FLIP_OUT = OUT / "flip-errors.jsonl"


def flip_errors(dtype: str, budget_s: float) -> Path:
    """For every position of honest completions: d = (a - b) under the sampler's decode
    logits minus (a - b) under the verifier's prefill logits (temperature-scaled), where a,
    b are the verifier's noisy top two. An honest flip at a tie of margin m needs d >= m;
    the distribution of |d| bounds the honest flip rate p0 of the steering test
    (sequential.py). Also the spread max - min of (decode - prefill) over the tokens that
    can reach the top two at all (a bound for any pair). One JSON line per completion."""
    import numpy as np
    from swarm_node.node.models import BUILTIN_SMOLLM2, ensure_builtin, load_model
    from swarm_node.node.sampler.hf import HFSampler
    from swarm_node.node.sampler.seeded import mask_logits
    from swarm_node.node.tasks import TaskSource, format_prompt, get_task
    from swarm_node.protocol import noise
    from swarm_node.protocol.messages import SamplingParams
    from swarm_node.verifier.checks import RolloutVerifier, noisy_top2, prefill_group

    model, tokenizer = load_model(ensure_builtin(BUILTIN_SMOLLM2), dtype=dtype)
    source = TaskSource(MIX, "default")
    OUT.mkdir(parents=True, exist_ok=True)
    specs = [v for v in variations(dtype) if "long" not in v[0]]
    per = budget_s / len(specs)
    round_ = 20_000 + int(time.time()) % 1_000_000
    with open(FLIP_OUT, "a") as out:
        for name, threads, max_batch, tasks, n, temp, top_p, max_new in specs:
            torch.set_num_threads(threads)
            params = SamplingParams(temperature=temp, top_p=top_p, max_new_tokens=max_new)
            v = RolloutVerifier(model, tokenizer, source, swarm_id="default",
                                latest_version=lambda: 0, dtype=dtype)
            t_end = time.monotonic() + per
            while time.monotonic() < t_end:
                sampler = HFSampler(model, tokenizer, peer_id=SENDER, max_batch=max_batch)
                # per _generate_rows call: [seeds, [logits per step], row -> prefill row]; the
                # first step's logits have one row per distinct prompt (a shared prefill)
                steps: list[list] = []
                rows_fn = sampler._generate_rows

                def record_rows(prompts, seeds, p, rows_fn=rows_fn, steps=steps):
                    first: dict[tuple[int, ...], int] = {}
                    steps.append([list(seeds), [], [first.setdefault(tuple(ids), len(first))
                                                    for _, ids in prompts]])
                    return rows_fn(prompts, seeds, p)

                sampler._generate_rows = record_rows
                hook = sampler.lm_head.register_forward_hook(
                    lambda mod, inp, y, steps=steps: steps[-1][1].append(
                        y.detach().float().clone()))
                refs = source.draw(SENDER, round_, tasks)
                prompts = [(r, format_prompt(tokenizer, get_task(r))) for r in refs]
                try:
                    groups = sampler.generate(prompts, n, params)
                finally:
                    hook.remove()
                decode = {seed: (call, r) for call, (seeds, _, _) in enumerate(steps)
                          for r, seed in enumerate(seeds)}
                for (_, prompt), group in zip(prompts, groups):
                    hiddens = prefill_group(model, prompt, [s_.completion_ids for s_ in group],
                                            v._pad_id(), 8192, v.prompt_cache, 0)
                    for smp, hidden in zip(group, hiddens):
                        call, r = decode[smp.seed]
                        t = len(smp.completion_ids)
                        _, logits, prefill_row = steps[call]
                        dec = torch.stack([logits[k][prefill_row[r] if k == 0 else r]
                                           for k in range(t)])
                        ver = v._logits(model, hidden)
                        # scaled in float32 as choose_tokens and the verifier do
                        dsc, vsc = (dec.float() / temp).double(), (ver.float() / temp).double()
                        strict = mask_logits(ver.float() / temp, params)
                        pos = torch.arange(t, dtype=torch.int64)
                        vals, idx = noisy_top2(strict, torch.full((t,), smp.seed,
                                                                  dtype=torch.int64), pos)
                        diff = dsc - vsc
                        d = (diff.gather(1, idx[:, :1]) - diff.gather(1, idx[:, 1:]))[:, 0]
                        reach = strict >= (vals[:, 1:] - noise.G_MAX - 1e-3)
                        spread = (diff.masked_fill(~reach, -np.inf).amax(1)
                                  - diff.masked_fill(~reach, np.inf).amin(1))
                        flips = [int(a) != b for a, b in zip(idx[:, 0], smp.completion_ids)]
                        # the per-peer tests' inputs as the verifier computes them (checks.py):
                        # claimed minus recomputed logprob, and where the claimed token is not
                        # the verifier's noisy best (a bootstrap pool without a second pass)
                        tok = torch.tensor(smp.completion_ids, dtype=torch.int64)
                        scaled = ver.float() / temp if temp > 0 else ver.float()
                        chosen = torch.log_softmax(scaled, -1).gather(1, tok[:, None])[:, 0]
                        err = smp.logprobs.float() - chosen
                        out.write(json.dumps({
                            "dtype": dtype, "variation": name, "len": t,
                            "abs_d": d.abs().tolist(), "spread": spread.tolist(),
                            "margin": (vals[:, 0] - vals[:, 1]).tolist(),
                            "flips": sum(flips), "flip_at": [k for k, f in enumerate(flips) if f],
                            "lp_err_sum": float(err.double().sum()), "lp_n": t,
                            "lp_err_max": float(err.abs().max())}) + "\n")
                out.flush()
                round_ += 1
                print(f"flip errors {dtype} {name}: round {round_}", flush=True)
    return FLIP_OUT


def flip_error_text() -> str:
    """The measured honest pair errors against the margin of a wide tie."""
    import numpy as np

    if not FLIP_OUT.exists():
        return ""
    parts = []
    recs = [json.loads(line) for line in FLIP_OUT.read_text().splitlines() if line.strip()]
    for dtype in sorted({r["dtype"] for r in recs}):
        rs = [r for r in recs if r["dtype"] == dtype]
        d = np.concatenate([r["abs_d"] for r in rs])
        spread = np.concatenate([r["spread"] for r in rs])
        from swarm_node.verifier.checks import CheckSettings

        wide = CheckSettings.for_dtype(dtype).tie_eps / 4
        over = int((d > wide).sum())
        rate = f"< {3 / len(d):.1e} at 95%" if over == 0 else f"{over / len(d):.1e}"
        parts.append(
            f"Honest flip errors ({dtype}, `--real-flip-errors`): {len(d)} positions of "
            f"{len(rs)} completions in {len({r['variation'] for r in rs})} variations. The "
            f"sampler's decode minus the verifier's prefill, on the score difference of the "
            f"verifier's noisy top two: median {np.median(d):.2e}, 99.9th percentile "
            f"{np.percentile(d, 99.9):.2e}, max **{d.max():.2e}**; {over} positions above a "
            f"wide tie's margin {wide:g} (rate {rate}). "
            f"Spread of (decode - prefill) over every token that can reach the top two: max "
            f"{spread.max():.2e}. Sampler and verifier picked different tokens at "
            f"{sum(r['flips'] for r in rs)} positions.\n")
    return "\n".join(parts)


# attacks on the real model under the thresholds of its dtype ----------------------------------


def attack_run(dtype: str, max_new_tokens: int = 8) -> Path:
    """Cheats on SmolLM2 in `dtype`, short completions (the widest proof limits), verified
    with `CheckSettings.for_dtype(dtype)`: other weights (x1.01, x1.02, x1.05), consistent
    token forgeries (1 token, re-proven), truncation + EOS, a forged reward. Writes
    attacks-<dtype>.json: attack -> {reason: count}."""
    import random
    from collections import Counter

    from swarm_node.node.models import BUILTIN_SMOLLM2, ensure_builtin, load_model
    from swarm_node.node.tasks import TaskSource
    from swarm_node.node.testing import attacks
    from swarm_node.protocol.messages import SamplingParams
    from swarm_node.verifier.checks import RolloutVerifier

    torch.set_num_threads(1)
    model, tokenizer = load_model(ensure_builtin(BUILTIN_SMOLLM2), dtype=dtype)
    source = TaskSource(MIX, "default")
    params = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=max_new_tokens)
    rng = random.Random(0)
    eos = tokenizer.eos_token_id
    out: dict[str, dict] = {}

    def sample(m, round_):
        b = attacks.sample_batch(m, tokenizer, source, SENDER, round_=round_, version=0,
                                 tasks=2, n=4, params=params, max_batch=8)
        return b.model_copy(update={"dtype": dtype})

    def check(name, batch):
        v = RolloutVerifier(model, tokenizer, source, swarm_id="default",
                            latest_version=lambda: 0, dtype=dtype)
        out[name] = dict(Counter(r.reason for r in v.verify(batch, SENDER)))
        print(name, out[name], flush=True)

    honest = sample(model, 1)
    check("honest (control)", honest)
    factors = os.environ.get("VERIFIER_REAL_FACTORS", "1.01,1.02,1.05")  # "" skips them
    for factor in [float(f) for f in factors.split(",") if f]:
        check(f"weights x{factor}", sample(attacks.scaled_copy(model, factor), 2))
    check("1 token changed, consistently re-proven",
          attacks.tamper_tokens(honest, rng, len(tokenizer), {eos}, model=model,
                                tokenizer=tokenizer))
    check("truncated, EOS appended (re-proven)",
          attacks.truncate_with_eos(honest, rng, eos, model, tokenizer))
    check("claimed reward forged", attacks.forge_reward(honest))
    path = OUT / f"attacks-{dtype}.json"
    path.write_text(json.dumps(out, indent=1))
    return path


def load(dtype: str) -> list[dict]:
    path = OUT / f"{dtype}.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# report ------------------------------------------------------------------------------------


def proof_ratios(rec: dict, th) -> tuple[float, float]:
    """(worst mean |rel err|, worst |bias|) of a completion's proof as fractions of its
    chunk's limits under `th` (ProofThresholds). Records keep the worst raw values (the
    collection runs with loose thresholds): exact for one chunk (T <= 32 tokens); for
    longer completions the full-chunk limit is applied to the worst raw value, which is
    never below the true ratio."""
    st = rec["stats"]
    mean_lim, bias_lim = th.limits(min(rec["len"], 32))
    return st["proof_mean_abs"] / mean_lim, st["proof_bias"] / bias_lim


def would_reject(rec: dict, s) -> str | None:
    """The reason `s` (CheckSettings) would give this honest completion, or None."""
    st = rec["stats"]
    p = s.proof
    if rec["reason"] != "ok":
        return rec["reason"]
    mean_ratio, bias_ratio = proof_ratios(rec, p)
    if st["proof_mismatches"] > p.max_mismatches:
        return "proof_index_mismatch"
    if mean_ratio > 1.0:
        return "proof_deviation"
    if bias_ratio > 1.0:
        return "proof_bias"
    if st["logprob_max_diff"] > s.logprob_tol:
        return "logprob_mismatch"
    worst = st["replay_max_gap"]
    # records before replay_second_gap existed: every gap <= worst, all inside tie_eps or not
    second = st.get("replay_second_gap", worst if worst <= s.tie_eps else math.inf)
    # the loose top-p mask also keeps tokens within tie_eps of its cut (checks._masks);
    # records before top_p_excess_near existed: the plain excess, never below it
    excess = st.get("top_p_excess_near", st.get("top_p_excess", -1.0))
    if worst > max(s.tie_eps, s.replay_outlier_eps) or second > s.tie_eps \
            or excess >= s.top_p_eps:
        return "token_mismatch"
    # only an EOS that was not the seeded choice (checks.py); records before eos_seeded
    # existed: every EOS, as the gate then was
    if "eos_prob" in st and st["eos_prob"] < s.min_eos_prob and not st.get("eos_seeded"):
        return "eos_improbable"
    if "shape_z" in st and abs(st["shape_z"]) > s.shape_z_max:
        return "sampling_shape"
    return None


def calibration_rows(recs: list[dict], s) -> list[list]:
    recs = [r for r in recs if r["reason"] == "ok"]  # rejected ones carry no statistics

    def worst(key, fn=max, absval=False):
        vals = [abs(r["stats"][key]) if absval else r["stats"][key]
                for r in recs if key in r["stats"]]
        return fn(vals) if vals else float("nan")

    p = s.proof
    ratios = list(zip(*(proof_ratios(r, p) for r in recs)))
    gaps = [r["stats"]["replay_max_gap"] for r in recs]
    near_excess = [r["stats"].get("top_p_excess_near", r["stats"]["top_p_excess"])
                   for r in recs if "top_p_excess" in r["stats"]]
    rows = [
        ["proof mismatches (of 128, per chunk)", worst("proof_mismatches"), p.max_mismatches],
        ["proof mean relative error", f"{worst('proof_mean_abs'):.2e}", f"{p.max_mean_abs:.2e}"
         + (" x sqrt(32/c)" if p.widen_short_chunks else "")],
        ["proof bias |mean signed error|", f"{worst('proof_bias'):.2e}", f"{p.max_bias:.2e}"
         + (" x sqrt(32/c) for a chunk of c < 32 tokens" if p.widen_short_chunks else "")],
        ["proof mean error / its chunk's limit", f"{max(ratios[0]):.2f}", 1],
        ["proof bias / its chunk's limit", f"{max(ratios[1]):.2f}", 1],
        ["logprob max |claimed - recomputed|", f"{worst('logprob_max_diff'):.3g}",
         s.logprob_tol],
        ["replay gap (claimed token behind the seeded choice), worst position",
         f"{worst('replay_max_gap'):.3g}",
         f"{s.tie_eps}" + (f"; one position per completion up to {s.replay_outlier_eps}"
                           if s.replay_outlier_eps > s.tie_eps else "")],
        ["replay gap, second-worst position (where recorded)",
         f"{worst('replay_second_gap'):.3g}", s.tie_eps],
        ["replay gap, worst position of the completions without an outlier",
         f"{max(g for g in gaps if g <= s.tie_eps):.3g}", s.tie_eps],
        ["completions with a replay outlier (a position beyond tie_eps)",
         f"{sum(g > s.tie_eps for g in gaps)} of {len(recs)}",
         "per-peer test p0 0.02" if s.replay_outlier_eps > s.tie_eps else "0 (off)"],
        ["top-p: mass ahead of the claimed token - top_p (top-p runs, where recorded)",
         f"{worst('top_p_excess'):.3g}", "-"],
        [("top-p: the same without the tokens within tie_eps of the claimed one (where "
         "recorded; else the line above)"), f"{max(near_excess, default=math.nan):.3g}",
         f"< {s.top_p_eps}"],
        ["|shape z|", f"{worst('shape_z', absval=True):.2f}".replace("nan", "- (all < 16 "
                                                                       "tokens)"),
         s.shape_z_max],
        ["EOS probability (min)", f"{worst('eos_prob', fn=min):.2e}", f"{s.min_eos_prob:.0e}"],
    ]
    return [["- (not recorded)" if c == "nan" else c for c in row] for row in rows]


# measured false-alarm rate and detection delay of the per-peer tests (bootstrap) ---------------


def _peer_stats(recs: list[dict], tie_eps: float,
                wide_min: float = 0.0) -> list[tuple[float, float, int, int, int]]:
    """Per honest completion: (lp_err_sum, lp_n, wide ties, honest flips at wide ties, 1 if
    a position trailed the seeded choice by more than tie_eps (a replay outlier) else 0).
    Wide: margin in (wide_min, tie_eps], wide_min 0 meaning the verifier's tie_eps / 4."""
    lo = wide_min or tie_eps / 4
    out = []
    for r in recs:
        st = r["stats"]
        wide = [f for m, f in zip(st.get("tie_margins", []), st.get("tie_flipped", []))
                if lo < m <= tie_eps]
        out.append((st["lp_err_sum"], st["lp_n"], len(wide), sum(wide),
                    int(st.get("replay_max_gap", 0.0) > tie_eps)))
    return out


def _run_peer(monitor, pool, rng, batches: int, batch: int, bias: float = 0.0,
              steer: float = 0.0, honest_flip: float = 0.0,
              until_alarm: bool = False) -> tuple[int, int | None, int | None]:
    """Feed `batches` batches of `batch` completions drawn with replacement from `pool` (a
    cheat applied on top) to a fresh peer in `monitor`; (alarming batches, first alarm's
    batch number or None, number of the first batch with a steered position or None).
    `steer`: share of the unflipped wide ties a cheater flips; `honest_flip`: the same for
    an honest peer whose floats reorder wide ties at that rate (the stress case: the test's
    own p0)."""
    peer = f"p{rng.integers(1 << 62)}"
    alarms, first, steered = 0, None, None
    for b in range(batches):
        hit = False
        for k in rng.integers(len(pool), size=batch).tolist():
            err, n, ties, flips, outlier = pool[k]
            if (steer or honest_flip) and ties > flips:  # (binomial(0, p) is 0)
                added = int(rng.binomial(ties - flips, steer or honest_flip))
                flips += added
                if steer and added and steered is None:
                    steered = b + 1
            hit |= monitor.observe(peer, {"lp_err_sum": err + bias * n, "lp_n": n,
                                          "wide_ties": ties, "wide_flips": flips,
                                          "replay_outliers": outlier}) is not None
        if hit:
            alarms += 1
            first = b + 1 if first is None else first
            if until_alarm:
                break
    return alarms, first, steered


BOOT_BATCHES = (32, 8)  # the protocol default (tasks_per_round 4 x completions_per_task 8), 8


def steering_freedom(recs: list[dict], tie_eps: float) -> dict:
    """Measured share of honest positions where a cheater may take the runner-up and still
    pass replay (top-two noisy margin <= tie_eps), and of those the per-peer test watches
    (wide: margin > tie_eps / 4). The collection ran with a loose tie_eps, so every margin up
    to it was recorded."""
    tokens = sum(r["len"] for r in recs)
    ties = wide = 0
    for r in recs:
        for m in r["stats"].get("tie_margins", []):
            ties += m <= tie_eps
            wide += tie_eps / 4 < m <= tie_eps
    return {"tokens": tokens, "ties": ties, "wide": wide}


def bootstrap(recs: list[dict], dtype: str, honest_batches: int = 40_000, batch: int = 32,
              peers: int = 100, attack_peers: int = 200, horizon: int = 200,
              seed: int = 0, seq=None, stress: tuple[float, ...] = ()) -> dict:
    """The per-peer CUSUMs (verifier/sequential.py, the real code) run on honest batches
    resampled from the measured honest per-completion statistics, and on the same with a
    cheat applied. Honest peers: `peers` peers share `honest_batches` batches; "pooled" draws
    from every completion, "one config" gives each peer one variation (its hardware and
    settings) and draws only from that variation's completions, which keeps a config's own
    bias; "stress" makes honest peers flip wide ties at the test's own p0 (what the
    false-alarm rate would be if honest floats reordered wide ties that often). Attacks:
    `attack_peers` cheaters each, batches to the first alarm (up to `horizon`). `seq`:
    SequentialSettings to measure instead of `for_dtype`'s (a candidate, side by side);
    `stress`: further honest flip rates to measure beyond p0. Detection delays are counted
    from the first batch and, for steering, also from the first batch in which the cheater
    had a tie to steer and steered it (`from_steer`: median, 95th percentile). Honest peers
    also feed their replay outliers (bf16) to the outlier test."""
    import numpy as np
    from swarm_node.verifier.checks import CheckSettings
    from swarm_node.verifier.sequential import PeerMonitor, SequentialSettings

    rng = np.random.default_rng(seed)
    s, seq = CheckSettings.for_dtype(dtype), seq or SequentialSettings.for_dtype(dtype)
    ok = [r for r in recs if r["reason"] == "ok"]
    pool = _peer_stats(ok, s.tie_eps, seq.wide_min)
    by_var: dict[str, list] = {}
    for r, st in zip(ok, pool):
        by_var.setdefault(r["variation"], []).append(st)
    per_peer = max(1, honest_batches // peers)
    honest = {}
    rows = [("pooled", [pool], 0.0), ("one config per peer", list(by_var.values()), 0.0),
            (f"stress: honest flips at p0 = {seq.flip_p0:.2g}", [pool], seq.flip_p0)]
    rows += [(f"stress beyond p0: honest flips at {f:.2g}", [pool], f) for f in stress]
    for label, pools, flip in rows:
        alarms = sum(_run_peer(PeerMonitor(seq), pools[i % len(pools)], rng, per_peer,
                               batch, honest_flip=flip)[0] for i in range(peers))
        honest[label] = (alarms, per_peer * peers)
    tol = s.logprob_tol
    cheats = [(f"logprob bias {-f * tol:+.3g}/token ({f:.0%} of the tolerance)",
               {"bias": -f * tol}) for f in (0.5, 0.2, 0.05)]
    cheats += [("steering: runner-up at every wide tie", {"steer": 1.0}),
               ("steering: runner-up at half the wide ties", {"steer": 0.5})]
    attacks = []
    for label, cheat in cheats:
        runs = [_run_peer(PeerMonitor(seq), pool, rng, horizon, batch, until_alarm=True,
                          **cheat)[1:] for _ in range(attack_peers)]
        delays = [first for first, _ in runs]
        got = sorted(d for d in delays if d is not None)
        within = sum(1 for d in got if d <= 20) / len(delays)
        row = [label, f"{np.median(got):.0f}" if got else "-",
               f"{np.percentile(got, 95):.0f}" if len(got) == len(delays) else
               f"> {horizon}", f"{within:.0%}", f"{len(delays) - len(got)} of {len(delays)}"]
        if "steer" in cheat:
            # batches from the first one with a steered position (1: alarmed in that batch);
            # a cheater that never steered (no tie in `horizon` batches) is not counted here
            from_steer = sorted(first - steered + 1 if first is not None else math.inf
                                for first, steered in runs if steered is not None)
            fin = [d for d in from_steer if d < math.inf]
            if not from_steer:
                row.append("- (no cheater steered)")
            else:
                p95 = np.percentile(from_steer, 95)
                row.append(f"{np.median(from_steer):.0f} / "
                           + (f"{p95:.0f}" if p95 < math.inf else f"> {horizon}")
                           + f" ({sum(1 for d in fin if d <= 20) / len(from_steer):.0%}"
                           + f" within 20 of {len(from_steer)})")
        else:
            row.append("-")
        attacks.append(row)
    wide = sum(p[2] for p in pool)
    return {"honest": honest, "attacks": attacks, "completions": len(pool),
            "wide_ties": wide, "wide_flips": sum(p[3] for p in pool), "settings": seq,
            "batch": batch, "freedom": steering_freedom(ok, s.tie_eps), "tie_eps": s.tie_eps}


# per dtype: (label, SequentialSettings fields replaced) measured beside `for_dtype`'s
ALTERNATIVES: dict[str, list[tuple[str, dict]]] = {}


def alternatives(dtype: str) -> list[tuple[str, dict]]:
    """ALTERNATIVES, plus for fp32 the single-flip steering test the measured honest flip
    errors would allow: p0 = the 95% bound 3 / N on P(|d| > tie_eps / 4) when none of the N
    measured positions exceeds it (`flip_errors`), and a threshold just below one flip's
    evidence log(p1 / p0), so one flipped wide tie alarms."""
    out = list(ALTERNATIVES.get(dtype, []))
    if dtype != "float32" or not FLIP_OUT.exists():
        return out
    from swarm_node.verifier.checks import CheckSettings
    from swarm_node.verifier.sequential import SequentialSettings

    recs = [json.loads(line) for line in FLIP_OUT.read_text().splitlines() if line.strip()]
    d = [x for r in recs if r["dtype"] == dtype for x in r["abs_d"]]
    wide = CheckSettings.for_dtype(dtype).tie_eps / 4
    if d and max(d) <= wide:
        p0 = 3 / len(d)
        h = math.log(SequentialSettings().flip_p1 / p0) - 0.5
        out.append(((f"alternative, one flip alarms (p0 {p0:.1e} = 3 / {len(d)} measured "
                    f"positions, steer_h {h:.1f})"),
                    {"flip_p0": p0, "steer_h": h}))
    return out


STEER_COL = ("from the first steered position: median / 95th (within 20 of the cheaters that "
             "steered)")


def flip_records(dtype: str) -> list[dict]:
    """The flip-error records (`flip_errors`) of `dtype` that carry the per-peer tests'
    inputs, as honest completions for `bootstrap`: the logprob error sum, and per near tie
    (margin <= tie_eps) its margin and whether the claimed token is not the verifier's noisy
    best, as checks._replay records them, from the same decode and prefill logits."""
    from swarm_node.verifier.checks import CheckSettings

    if not FLIP_OUT.exists():
        return []
    tie_eps = CheckSettings.for_dtype(dtype).tie_eps
    out = []
    for line in FLIP_OUT.read_text().splitlines():
        r = json.loads(line) if line.strip() else {}
        if r.get("dtype") != dtype or "lp_err_sum" not in r:
            continue
        flipped = set(r["flip_at"])
        ties = [k for k, m in enumerate(r["margin"]) if m <= tie_eps]
        out.append({"reason": "ok", "variation": r["variation"], "len": r["len"], "stats": {
            "lp_err_sum": r["lp_err_sum"], "lp_n": r["lp_n"],
            "tie_margins": [r["margin"][k] for k in ties],
            "tie_flipped": [k in flipped for k in ties]}})
    return out


def synthetic_ties(recs: list[dict], rate: float, tie_eps: float, copies: int = 20,
                   seed: int = 0) -> list[dict]:
    """`copies` copies of each honest completion whose near ties are replaced by Poisson(rate
    x length) ties with margins uniform in (0, tie_eps] and no honest flip (none of the
    measured pair errors reaches a counted margin): the flip-error data holds too few ties
    to resample their frequency (a handful in ~16,000 positions), so the tie rate comes from
    a larger count (session 7: 13 ties <= 1e-3 in 17,380 positions)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    out = []
    for r in recs:
        for _ in range(copies):
            k = int(rng.poisson(rate * r["len"]))
            out.append({**r, "stats": {**r["stats"],
                                       "tie_margins": rng.uniform(0, tie_eps, k).tolist(),
                                       "tie_flipped": [False] * k}})
    return out


def steering_study(dtype: str = "float32", wide_mins: tuple[float, ...] = (1e-4,),
                   stress: float = 1e-3, only: str = "", tie_rate: float = 0.0) -> str:
    """fp32 steering at batch 8 (issue #11): the honest flip errors against each tie margin,
    a p0 bound from them, and the bootstrap of the current test beside one-flip tests (p0 the
    95% bound 3 / N when none of the N measured positions' pair error exceeds the smallest
    counted margin; threshold just below one flip's evidence) on the tie margins of the
    verifier's wide ties and of narrower ones (`wide_mins`), all on the honest completions of
    the flip-error data. `only`: measure just the candidates whose label contains it (one
    process per candidate). `tie_rate` > 0: the bootstrap's completions get synthetic ties
    at that rate per position (`synthetic_ties`). Markdown for a hand-written RESULTS.md
    section."""
    import dataclasses

    import numpy as np
    from swarm_node.verifier.checks import CheckSettings
    from swarm_node.verifier.sequential import SequentialSettings

    from benchmarks.results import table

    tie_eps = CheckSettings.for_dtype(dtype).tie_eps
    raw = [json.loads(line) for line in FLIP_OUT.read_text().splitlines() if line.strip()]
    raw = [r for r in raw if r["dtype"] == dtype]
    d = np.concatenate([r["abs_d"] for r in raw])
    m = np.concatenate([r["margin"] for r in raw])
    recs = flip_records(dtype)
    if tie_rate:
        recs = synthetic_ties(recs, tie_rate, tie_eps)
    n_pos = len(d)
    lines = [f"Flip-error data: {n_pos} positions of {len(raw)} completions "
             f"({sum(r['len'] for r in recs)} positions of {len(recs)} completions carry the "
             f"per-peer inputs and feed the bootstrap); variations: "
             + ", ".join(f"{v} {sum(r['len'] for r in raw if r['variation'] == v)}"
                         for v in sorted({r["variation"] for r in raw}))
             + f". Pair error |d|: median {np.median(d):.2e}, 99.9th percentile "
             f"{np.percentile(d, 99.9):.2e}, max **{d.max():.2e}**. Sampler and verifier "
             f"picked different tokens at {sum(r['flips'] for r in raw)} positions.\n"]
    rows = []
    for lo in sorted({tie_eps / 4, *wide_mins, 5e-5}):
        over = int((d > lo).sum())
        ties = int(((m > lo) & (m <= tie_eps)).sum())
        rows.append([f"{lo:g}", over, f"{3 / n_pos:.2e}" if over == 0 else f"{over / n_pos:.2e}",
                     ties, f"{ties / n_pos * 1e3:.3f}"])
    lines.append(table(["counted ties: margin above", "positions with |d| above it",
                        "P(|d| above it), 95% bound (3 / N when 0)",
                        f"ties with margin in (it, {tie_eps:g}]", "per 1,000 positions"], rows))
    # session 7's fp32 steering test (two flips alarm), whatever for_dtype says now
    base = dataclasses.replace(SequentialSettings.for_dtype(dtype), flip_p0=1e-3, steer_h=0.0,
                               wide_min=0.0)
    cands = [("session 7 (p0 0.001, h 12: two flips alarm)", base,
              (stress,) if stress != base.flip_p0 else ())]
    if not (d > tie_eps / 4).sum():
        p0 = 3 / n_pos  # the same two-flip test on the new bound
        cands.append((f"two flips alarm (p0 {p0:.2e}, h {base.h:g})",
                      dataclasses.replace(base, flip_p0=p0), (stress,)))
    for lo in (0.0, *wide_mins):
        if (d > (lo or tie_eps / 4)).sum():
            continue  # an honest pair error above the margin: no bound of this kind
        p0 = 3 / n_pos
        h = math.log(base.flip_p1 / p0) - 0.5
        label = (f"one flip alarms, ties above {lo or tie_eps / 4:g} (p0 {p0:.2e}, "
                 f"steer_h {h:.2f})")
        cands.append((label,
                      dataclasses.replace(base, flip_p0=p0, steer_h=h, wide_min=lo),
                      (stress,)))
    hon, att = [], []
    for label, seq, extra in [c for c in cands if only in c[0]]:
        for b in BOOT_BATCHES:
            run = bootstrap(recs, dtype, batch=b, seq=seq, stress=extra)
            for what, (alarms, n) in run["honest"].items():
                hon.append([f"{label}: batch {b}: {what}", n, f"**{alarms}**",
                            f"< {3 / n:.1e} (95%)" if alarms == 0 else f"{alarms / n:.1e}"])
            att += [[f"{label}: batch {b}: {row[0]}", *row[1:]] for row in run["attacks"]
                    if "steering" in row[0]]
            per_batch = run["wide_ties"] / run["completions"] * b
            lines.append(f"- {label}, batch {b}: {run['wide_ties']} counted ties in "
                         f"{run['completions']} completions ({per_batch:.3f} per batch), "
                         f"{run['wide_flips']} honest flips among them")
    lines.append("")
    lines.append(table(["honest peers", "batches", "false alarms", "rate per batch"], hon))
    lines.append("")
    lines.append(table(["cheat", "median batches to alarm (from batch 1)", "95th percentile",
                        "caught within 20 batches", "never caught in 200", STEER_COL], att))
    return "\n".join(lines)


def _run_label(run: dict) -> str:
    return f"{run['label']}: " if "label" in run else ""


def bootstrap_text(dtype: str, recs: list[dict]) -> str:
    import dataclasses

    from swarm_node.verifier.sequential import SequentialSettings

    from benchmarks.results import table

    runs = [bootstrap(recs, dtype, batch=b) for b in BOOT_BATCHES]
    # alternatives measured side by side on the same data (ALTERNATIVES)
    for label, kw in alternatives(dtype):
        alt = dataclasses.replace(SequentialSettings.for_dtype(dtype), **kw)
        runs += [{**bootstrap(recs, dtype, batch=b, seq=alt), "label": label}
                 for b in BOOT_BATCHES]
    b = runs[0]
    st, fr = b["settings"], b["freedom"]
    lines = [(f"Per-peer sequential tests, measured by bootstrap ({dtype}): honest batches "
              f"resampled from the {b['completions']} measured honest completions and fed to "
              f"the real `PeerMonitor` (`SequentialSettings.for_dtype`: bias mu0 "
              f"{st.bias_mu:+.3g}, sigma0 {st.bias_sigma:.3g}, k {st.bias_k}, clip "
              f"{st.bias_clip}; steering p0 {st.flip_p0}, p1 {st.flip_p1}; h {st.h}), at "
              f"batch {BOOT_BATCHES[0]} (the protocol default: tasks_per_round 4 x "
              f"completions_per_task 8) and batch {BOOT_BATCHES[1]}. Honest wide ties in the "
              f"data: {b['wide_ties']}, flipped {b['wide_flips']}. Steering freedom "
              f"(measured): {fr['ties']} of {fr['tokens']} honest positions "
              f"({fr['ties'] / max(1, fr['tokens']):.3%}) have a top-two margin <= tie_eps "
              f"{b['tie_eps']} (a cheater may take the runner-up there and pass replay); "
              f"{fr['wide']} of them ({fr['wide'] / max(1, fr['tokens']):.3%} of positions) "
              "are wide ties the steering test watches, the rest it cannot tell from "
              "honest float noise.\n")]
    rows = []
    for run in runs:
        for label, (alarms, n) in run["honest"].items():
            bound = 3 / n if alarms == 0 else None
            rows.append([f"{_run_label(run)}batch {run['batch']}: {label}", n, f"**{alarms}**",
                         f"< {bound:.1e} (95%)" if bound else f"{alarms / n:.1e}"])
    lines.append(table(["honest peers", "batches", "false alarms", "rate per batch"], rows))
    lines.append("\nCheats on top of the same resampled honest statistics (200 cheating peers "
                 "each, 200 batches at most):\n")
    lines.append(table(["cheat", "median batches to alarm", "95th percentile",
                        "caught within 20 batches", "never caught in 200", STEER_COL],
                       [[f"{_run_label(run)}batch {run['batch']}: {row[0]}", *row[1:]]
                        for run in runs for row in run["attacks"]]))
    return "\n".join(lines)


def variation_rows(recs: list[dict], s) -> list[list]:
    by: dict[str, list] = {}
    for r in recs:
        by.setdefault(r["variation"], []).append(would_reject(r, s))
    return [[name, len(v), sum(1 for x in v if x) or "-"] for name, v in by.items()]


def report(load_avg: str) -> str:
    from swarm_node.verifier.checks import CheckSettings

    from benchmarks.results import table

    intro = (f"Real model: SmolLM2-135M-Instruct (`builtin:smollm2-135m`), CPU. Task mix "
             f"{', '.join(MIX)} (prompts of ~37 and ~130 tokens mixed in one batch). "
             f"Load average during the runs: {load_avg} (2 cores shared with the other "
             "engineers). Every completion is verified with loose thresholds so that all its "
             "statistics are kept; the tables say what `CheckSettings.for_dtype` would do.\n")
    parts = [intro]
    for dtype in ("float32", "bfloat16"):
        recs = load(dtype)
        if not recs:
            parts.append(f"### {dtype}: no data collected\n")
            continue
        s = CheckSettings.for_dtype(dtype)
        rejects: dict[str, int] = {}
        for r in recs:
            why = would_reject(r, s)
            if why:
                rejects[why] = rejects.get(why, 0) + 1
        nvar = len({r["variation"] for r in recs})
        parts.append(f"### {dtype}: {len(recs)} honest completions in {nvar} variations, "
                     f"**{sum(rejects.values())} false rejects** under "
                     f"`CheckSettings.for_dtype(\"{dtype}\")`"
                     + (f" ({rejects})" if rejects else "") + "\n")
        parts.append(table(["variation (sampler; the verifier prefills)", "completions",
                            "would be rejected"], variation_rows(recs, s)))
        parts.append("")
        parts.append(table(["statistic", "worst honest", "threshold"],
                           calibration_rows(recs, s)))
        parts.append("")
        parts.append(bootstrap_text(dtype, recs))
        parts.append("")
    parts.append(flip_error_text())
    for dtype in ("bfloat16", "float32"):
        path = OUT / f"attacks-{dtype}.json"
        if path.exists():
            got = json.loads(path.read_text())
            parts.append(f"### Attacks on SmolLM2 in {dtype}, 8-token completions (batch of "
                         f"2 tasks x 4), `CheckSettings.for_dtype(\"{dtype}\")`\n")
            parts.append(table(["attack", "verdicts"], [
                [k, ", ".join(f"{r}={n}" for r, n in sorted(v.items()))]
                for k, v in got.items()]))
            parts.append("")
    rows = cost_table()
    if rows:
        parts.append("### Cost: verification / generation on the same batches, baseline "
                     "(commit e83ff02) vs now\n")
        parts.append(table(COST_HEADER, rows))
    parts.append(NOTES)
    return "\n".join(parts)


NOTES = """
Notes (written by hand after the runs; honest about what this is and is not):
- Collection. fp32: the 634 completions of sessions 3-4 (not re-collected; rows "session
  3: ..." are session 3's, unmarked rows session 4's). bf16: sessions 3-5's T = 1
  completions, session 5's top-p round and session 6's first three top-p rounds
  re-verified under session 6's rules (rows "re-verified": the same batches, replayed; the
  replay reproduces a round's batch exactly), and session 6's new ones (rows "session 6:
  ..."), sampled at nice 10 from 18:04 UTC, first on a quiet machine (load ~1, a batch of
  32 x 8 bf16 tokens in ~2 min), later beside the other engineers' work (load 3-17). One
  SmolLM2 process at a time. The statistics do not depend on load.
- bf16 false rejects found and fixed (session 6). The new top-p data gave another honest
  reject: a T = 0.7 top-p 0.9 token with 4.8% of mass beyond top_p ahead of it at the
  verifier (top_p_eps 0.01). Diagnosis (its round replayed with the sampler's decode
  logits recorded): the sampler's own mass ahead of the token was 0.897 < 0.9; at the
  verifier one token (4.3% of mass) 0.18 (scaled) above it had swapped places with it. And
  three more completions needed session 5's one-outlier allowance (replay gaps 1.57, 1.48,
  1.31), all in top-p runs (0 of ~430 T = 1 completions). Both are the top-p cut moving
  with honest float differences: by order (scores within tie_eps swap) and by mass. The
  replay masks now allow for both (checks._masks, NODE_SPEC 5.2 token_mismatch): the
  claimed token may be any token of top_p + top_p_eps or within tie_eps below that cut;
  the best noisy score is taken over the tokens the sampler surely had (top_p - top_p_eps,
  tokens within tie_eps below each counted ahead of it). The four batches with the
  outliers and the reject, replayed and verified under the new masks: worst gaps 0.085,
  0.032, 0.057, 0.168, no reject. The outlier allowance (session 5, replay_outlier_eps
  2.0) was switched off on that evidence (commit 27b68d0) and back on an hour later: a
  new honest T = 1 completion of 63 tokens trailed by 0.43 at one position (tie_eps 0.4;
  second-worst 0.16), and the diagnosis run measured single bf16 logits differing by up
  to 0.74 (scaled, T = 0.7) between decode and prefill, so a pair can differ by ~1.5.
  That completion is the one "replay outlier" above (1 in 600; the per-peer outlier
  test's p0 is 0.02). Price as before: a sender may take a token within 2.0 of the seeded
  choice at one position in roughly 1 completion in 10 without being caught. The top-p
  excess without near-tied tokens is
  the quantity top_p_eps now bounds (worst 0.004 against 0.01; the plain excess, 0.048,
  is shown for the record). A first version of the masks also counted as a steering
  "flip" a top-p token that beat the tight mask's best (the sampler's own choice at the
  cut): the bootstrap then alarmed honest T = 0.7 peers (hundreds of alarms in 40,000
  batches, one config per peer). A flip is now a claimed token trailing the best; the
  top-p rounds were re-verified once more with that (the rows "re-verified"). The bf16
  attacks table is session 5's (T = 1: the mask change does not touch it; the outlier
  allowance it ran with is still on); the scaled-weight
  rows are session 4's. fp32 top-p statistics are sessions 3-4's (plain masks; with
  fp32's top_p_eps 1e-4 and tie_eps 1e-3 the masks differ only in the last digits).
- fp32 honest flip errors (`--real-flip-errors float32`, session 6, nice 10 at load
  7-17): measured directly for the first time on SmolLM2 (the line above the attacks).
  No position of 4,659 comes near a wide tie's margin 2.5e-4 (max 4.2e-5): P(honest flip
  at a wide tie) < 6.4e-4 at 95%, below the steering test's p0 1e-3, which now rests on
  this measurement (session 5: on the logprob errors).
- fp32 steering at batch 8 (issue goal: detection within 20 batches). The limit is the
  evidence: 11 wide ties in 17,380 honest positions, ~0.14 per batch of 8, so a cheater
  steering every wide tie meets none in 20 batches with probability ~6%. The current test
  needs two flips (p0 1e-3, h 12): median 13, 95th percentile 34 batches. The sharpest
  sound alternative measured beside it (rows "alternative"): one flip alarms, p0 from the
  flip-error bound (6.4e-4): median 6, 95th percentile 21 (94% within 20) at batch 8; 2 / 6
  at batch 32; but if honest peers flipped wide ties at that bound, 1.7e-4 (batch 8) and
  4.0e-4 (batch 32) false alarms per batch, above the goal of 1e-4, and one honest flip
  (other hardware whose errors are inside logprob_tol 1e-3 but above the 4e-5 measured
  here) would already penalise. Not adopted then; session 8 adopted it on 16,913 positions
  (p0 1.77e-4; RESULTS.md "fp32 steering at batch 8, session 8", written by hand). A margin-weighted test cannot help either:
  the narrow ties (m <= 2.5e-4) add 2 of 13 ties and are where honest flips happen. At
  batch 32 (the protocol default) the goal holds: 3 / 9.
- Cost (`--real-cost float32 --real-cost-batches 5` under the bench lock, 18:43-18:48
  UTC, load 8.4 -> 7.1; no quiet slot): CPU seconds of the process. Today's verifier vs
  the baseline (e83ff02) on the same batches: batch 8 T=1 34.7% -> 29.6%, top-p 55.7% ->
  30.2%, 2 threads 30.2% -> 25.9%, batch 32 33.6% -> 28.0%. No saving was found this
  session: a profile of a batch of 8 on the quiet machine (18:09, load 0.6): 1.2-1.5 CPU-s
  of verification against ~4.0 s of generation (31-35%, higher than under load, where
  generation slows more), 72% of it in matrix products running at ~84 GFLOP/s against a
  measured peak of 88-93 (decoder shapes) and 70 (LM head); the seeded replay's noise
  hashing ~0.15-0.2 s (an alternative top-two over the candidates only was no faster:
  19-21 ms per completion either way), the shape test 0.03-0.05 s. The new last column
  says what is physically possible: the verifier's linear-layer FLOPs at the GEMM peak
  measured in the same process are 14.5% of generation at batch 8 (10-16% across the
  rows) before attention, norms, replay or anything else. The goal of 15% is out of
  reach on this CPU: the verifier must run the forward and the LM head at every
  completion token (the trainer trains on the recomputed logprobs, replay checks every
  token). Amortised with spot checks at 10%: 2.7-3.2% (goal 3%: met at 2 threads and
  batch 32, 3.2% at batch 8 under this load).
- Calibration size: 634 fp32 and, now, >= 500 bf16 honest completions (see the headers),
  0 false rejects under the final rules. bf16 logprob_tol went 0.5 -> 1.0 in session 4
  after an honest 0.65; the short-chunk proof widening (x sqrt(32/c)) is session 4's,
  after an honest 8-token proof bias of 2.19e-2.
- Per-peer tests: measured by resampling (bootstrap) the honest per-completion statistics
  into 40,000 honest batches per dtype, scheme and batch size, with the real PeerMonitor;
  a peer pinned to one variation keeps that config's own bias; honest peers also feed
  their replay outliers (1 in 600). Honest bf16 false alarms: 0 pooled, 1 in 40,000
  batches of 32 with each peer pinned to one config (2.5e-5; goal 1e-4). The stress rows
  give honest peers wide-tie flips at the test's own p0 (bf16 0.1, ~3x the measured 34 of
  1,110): at batch 8 5e-5, at batch 32 2.8e-4, above the goal (session 5, on 284
  completions without the 64-token ones, which carry many wide ties: 5e-5): if honest
  hardware flipped wide ties 3x as often as measured here, bf16 peers at the default
  batch would see about 3 false alarms in 10,000 batches. Resampling treats completions as
  independent draws from the measured ones: a config not measured (GPU kernels, another
  model) is not covered.
"""
