"""Verifier calibration, attack detection, proof fuzzing and costs, side by side with toploc.

    .venv/bin/python benchmarks/verifier.py            # full run (~15-25 min on 2 busy cores)
    .venv/bin/python benchmarks/verifier.py --quick    # smoke run, nothing recorded

1. Honest variations (must all be accepted): sampler batch sizes 64 / 7 / 1 (padding and
   batch composition from three toy families with different prompt lengths), 1 vs 2 torch
   threads, temperature/top-p settings, KV-cached decode vs the verifier's full prefill, and
   the verifier prefilling in batches vs one completion at a time.
2. Attacks (must be rejected), with the reason codes that fired; proof-only detection of
   ours and of toploc on the same hidden states.
3. 100,000 fuzzed / mutated proofs: crashes and accepts (toploc: malformed proofs, each in
   its own subprocess).
4. Costs: proof build as % of generation time and verify / generation time for 256-token
   completions; build/verify microseconds per token for ours and toploc on the same states.

toploc 0.1.6 runs from .venv-toploc (see REFERENCE.md §3) in a subprocess.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.results import record, table

TOPLOC_PY = ROOT / ".venv-toploc" / "bin" / "python"
SENDER = "12D3KooWBenchInferencePeer"
VERSION = 5


def _imports():
    global attacks, checks, proof, SamplingParams, TaskSource, load_model, build_tiny_model
    from swarm_node.node.models import build_tiny_model, load_model
    from swarm_node.node.tasks import TaskSource
    from swarm_node.node.testing import attacks
    from swarm_node.protocol.messages import SamplingParams
    from swarm_node.verifier import checks, proof


# toploc --------------------------------------------------------------------------------


def toploc_available() -> str | None:
    """None when usable, else why not."""
    if not TOPLOC_PY.exists():
        return f"{TOPLOC_PY} missing (build: REFERENCE.md §3)"
    r = subprocess.run([str(TOPLOC_PY), "-c", "import toploc"], capture_output=True, text=True,
                       check=False)
    return None if r.returncode == 0 else f"import toploc failed: {r.stderr.strip()[-300:]}"


def run_toploc(workdir: Path, name: str, arrays: dict[str, np.ndarray],
               cases: list[dict]) -> list[dict]:
    """Run toploc on `cases`; a case that kills the process gets {"crash": signal}."""
    npz = workdir / f"{name}.npz"
    np.savez(npz, **arrays)
    job = workdir / f"{name}.json"
    job.write_text(json.dumps({"npz": str(npz), "cases": cases}))
    out = workdir / f"{name}.jsonl"
    out.unlink(missing_ok=True)
    results: dict[int, dict] = {}
    start = 0
    while start < len(cases):
        r = subprocess.run([str(TOPLOC_PY), str(ROOT / "benchmarks" / "toploc_worker.py"),
                            str(job), str(out), str(start)], capture_output=True, text=True,
                           timeout=3600, check=False)
        if out.exists():
            for line in out.read_text().splitlines():
                rec = json.loads(line)
                results[rec["i"]] = rec
        done = max(results, default=-1) + 1
        if r.returncode != 0:
            results[done] = {"i": done, "crash": r.returncode,
                             "stderr": r.stderr.strip().splitlines()[-1:] if r.stderr else []}
            done += 1
        start = done
    return [results[i] for i in range(len(cases))]


def toploc_accepts(rec: dict, expected_chunks: int) -> bool:
    """The reference thresholds (REFERENCE.md §3); toploc itself applies none and checks
    only the proofs it is given."""
    if "crash" in rec:
        return False
    del expected_chunks  # toploc does not compare the count (fewer proofs pass silently)
    return all(m <= 38 and mean <= 10 and med <= 8 for m, mean, med in rec["chunks"])


# sampling helpers ------------------------------------------------------------------------


class Kit:
    def __init__(self, workdir: Path):
        d0, d1 = workdir / "tiny0", workdir / "tiny1"
        build_tiny_model(d0, seed=0)
        build_tiny_model(d1, seed=1)
        self.model, self.tokenizer = load_model(d0)
        self.other, _ = load_model(d1)
        self.source = TaskSource({"toy/digit_successor": 1.0, "toy/digit_copy": 1.0,
                                  "toy/digit_predecessor": 1.0}, "bench")
        self.round = 0

    def sample(self, model=None, *, tasks: int, n: int, params, max_batch: int = 64,
               hidden_out: list | None = None, label_round: int | None = None):
        self.round += 1
        return attacks.sample_batch(model or self.model, self.tokenizer, self.source, SENDER,
                                    round_=self.round, version=VERSION, tasks=tasks, n=n,
                                    params=params, swarm_id="bench", max_batch=max_batch,
                                    hidden_out=hidden_out, label_round=label_round)

    def verifier(self, **settings):
        return checks.RolloutVerifier(
            lambda v: self.model if v == VERSION else None, self.tokenizer, self.source,
            swarm_id="bench", latest_version=lambda: VERSION,
            settings=checks.CheckSettings(**settings), max_context=1024)

    def recompute(self, batch):
        pairs = [(c.prompt_ids.to_numpy(), c.completion_ids.to_numpy()) for c in batch.completions]
        return [h for h, _ in checks.prefill(self.model, pairs, self.tokenizer.pad_token_id)]


# 1. honest -------------------------------------------------------------------------------


def honest_variations(kit: Kit, scale: int):
    P = SamplingParams
    base = P(temperature=1.0, top_p=1.0, max_new_tokens=48)
    # (name, params, max_batch, threads, tasks, n, repeats)
    plan = [
        ("decode batch 64, 1 thread, T=1", base, 64, 1, 16, 8, 4),
        ("decode batch 7, 2 threads, T=1", base, 7, 2, 8, 8, 2),
        ("decode batch 1 (no padding), 1 thread", base, 1, 1, 8, 4, 2),
        ("decode batch 64, T=0.7 top-p 0.9", P(temperature=0.7, top_p=0.9, max_new_tokens=48),
         64, 1, 16, 8, 2),
        ("decode batch 32, T=1.3 top-p 0.95, 2 threads",
         P(temperature=1.3, top_p=0.95, max_new_tokens=48), 32, 2, 8, 8, 2),
        ("decode batch 64, greedy (T=0)", P(temperature=0.0, max_new_tokens=48), 64, 1, 16, 4, 1),
    ]
    for name, params, max_batch, threads, tasks, n, repeats in plan:
        for _ in range(max(1, repeats * scale // 4)):
            torch.set_num_threads(threads)
            hidden: list = []
            t0 = time.perf_counter()
            batch = kit.sample(tasks=tasks, n=n, params=params, max_batch=max_batch,
                               hidden_out=hidden)
            torch.set_num_threads(1)
            print(f"  honest: {name}: {len(batch.completions)} completions "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
            yield name, batch, hidden, time.perf_counter() - t0


def run_honest(kit: Kit, scale: int, toploc_ok: bool, workdir: Path):
    rows, stats_all = {}, []
    tl_arrays, tl_cases = {}, []
    for name, batch, hidden, _ in honest_variations(kit, scale):
        for label, v in (("batched prefill", kit.verifier()),
                         ("one prefill per completion", kit.verifier(prefill_token_budget=1))):
            results = v.verify(batch, SENDER)
            row = rows.setdefault(f"{name}; verifier {label}", Counter())
            row["n"] += len(results)
            row["accepted"] += sum(r.accept for r in results)
            for r in results:
                if not r.accept:
                    row[f"reject:{r.reason}"] += 1
                    print("FALSE REJECT", name, label, r.reason, r.detail)
                stats_all.append(r.stats)
        if toploc_ok:
            for c_idx, (h_p, h_v) in enumerate(zip(hidden, kit.recompute(batch))):
                key = f"c{len(tl_cases)}"
                tl_arrays[key + "p"], tl_arrays[key + "v"] = h_p.numpy(), h_v.numpy()
                tl_cases.append({"prover": key + "p", "verifier": key + "v"})
    completions = sum(r["n"] for k, r in rows.items() if "batched" in k)
    tl = None
    if toploc_ok and tl_cases:
        res = run_toploc(workdir, "honest", tl_arrays, tl_cases)
        tl = (sum(toploc_accepts(r, 0) for r in res), len(res))
    return rows, stats_all, completions, tl


# 2. attacks ------------------------------------------------------------------------------


def run_attacks(kit: Kit, n_tasks: int, toploc_ok: bool, workdir: Path):
    params = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=48)
    tok = kit.tokenizer
    vocab, eos = len(tok), tok.eos_token_id
    rng = random.Random(0)
    base_hidden: list = []
    base = kit.sample(tasks=n_tasks, n=4, params=params, hidden_out=base_hidden)
    # Token attacks need something to change: drop completions that are a lone EOS.
    keep = [i for i, c in enumerate(base.completions) if c.completion_ids.shape[0] >= 2]
    base = base.model_copy(update={"completions": [base.completions[i] for i in keep]})
    base_hidden = [base_hidden[i] for i in keep]
    out = []

    def add(name, batch, prover_hidden, verifier=None, sender=SENDER):
        """prover_hidden: what the attacker's proofs commit to (None: toploc n/a)."""
        v = verifier or kit.verifier()
        results = v.verify(batch, sender)
        ours_proof = None
        tl_case = None
        if prover_hidden is not None:
            recomputed = kit.recompute(batch)
            ours_proof = [proof.verify_proof(c.proof, h).ok
                          for c, h in zip(batch.completions, recomputed)]
            tl_case = (prover_hidden, recomputed)
        out.append({"name": name, "results": results, "ours_proof_ok": ours_proof,
                    "toploc": tl_case, "batch": batch})

    for label, forged in (("different model (tiny seed 1)", kit.other),
                          ("weights x 1.01", attacks.scaled_copy(kit.model, 1.01)),
                          ("weights 1% mixed with another model",
                           attacks.mixed_copy(kit.model, kit.other, 0.01)),
                          ("weights 0.1% mixed with another model",
                           attacks.mixed_copy(kit.model, kit.other, 0.001))):
        hidden: list = []
        add(label, kit.sample(forged, tasks=n_tasks, n=4, params=params, hidden_out=hidden), hidden)

    add("one token changed, proof kept",
        attacks.tamper_tokens(base, rng, vocab, {eos}), base_hidden)
    for span in (1, 8):
        h: dict = {}
        b = attacks.tamper_tokens(base, rng, vocab, {eos}, span=span, model=kit.model,
                                  tokenizer=tok, hidden_out=h)
        add(f"{span} token(s) changed, consistently re-proven", b, [h[i] for i in range(len(h))])
    add("one logprob shifted by 0.05", attacks.tamper_logprobs(base, rng), None)
    add("all logprobs claimed 0 (p=1)", base.model_copy(update={"completions": [
        c.model_copy(update={"logprobs": type(c.logprobs).from_numpy(
            np.zeros(c.logprobs.shape, np.float32))}) for c in base.completions]}), None)
    partners = attacks.proof_partners(base)
    add("proof from another completion", attacks.swap_proofs(base),
        [base_hidden[j] for j in partners])
    h = {}
    b = attacks.truncate_with_eos(base, rng, eos, kit.model, tok, hidden_out=h)
    add("truncated, EOS appended (re-proven)", b, [h[i] for i in range(len(h))])
    add("tokens after EOS (re-proven)",
        attacks.append_after_eos(base, rng, vocab, eos, kit.model, tok), None)
    add("claimed reward forged", attacks.forge_reward(base), None)
    v = kit.verifier()
    v.verify(base, SENDER)
    add("replayed batch (same round)", base, None, verifier=v)
    add("replayed rollouts (next round)", base.model_copy(update={"round": base.round + 1}),
        None, verifier=v)
    add("relayed under another sender", base, None, sender="12D3KooWRelayingPeer")
    for label, decode_model, decode_params in (
            ("cheap decode (other model) + real prefill", kit.other, params),
            ("greedy decode + real prefill, claims T=1", kit.model,
             SamplingParams(temperature=0.0, max_new_tokens=48)),
            ("decode at T=0.5 + real prefill, claims T=1", kit.model,
             SamplingParams(temperature=0.5, max_new_tokens=48))):
        b = kit.sample(decode_model, tasks=n_tasks, n=4, params=decode_params)
        b = b.model_copy(update={"sampling": params})
        h = {}
        b = attacks.reprove(b, kit.model, tok, hidden_out=h)
        add(label, b, [h[i] for i in range(len(h))])
    add("task not assigned by the seed",
        kit.sample(tasks=n_tasks, n=2, params=params, label_round=10_000), None)

    tl_res = None
    if toploc_ok:
        arrays, cases, owners = {}, [], []
        for k, a in enumerate(out):
            if a["toploc"] is None:
                continue
            for j, (hp, hv) in enumerate(zip(*a["toploc"])):
                key = f"a{k}_{j}"
                arrays[key + "p"], arrays[key + "v"] = hp.numpy(), hv.numpy()
                cases.append({"prover": key + "p", "verifier": key + "v"})
                owners.append(k)
        res = run_toploc(workdir, "attacks", arrays, cases)
        tl_res = Counter()
        for k, r in zip(owners, res):
            tl_res[(k, "n")] += 1
            tl_res[(k, "rejected")] += not toploc_accepts(r, 0)
    return out, tl_res


def shape_detection(kit: Kit, attack) -> float:
    """Fraction rejected by the sampling-shape check alone (|z| > z_max)."""
    z_max = checks.CheckSettings().shape_z_max
    params = attack["batch"].sampling
    hits = 0
    for c in attack["batch"].completions:
        tokens = torch.from_numpy(c.completion_ids.to_numpy().astype("int64"))
        (_, logits), = checks.prefill(kit.model, [(c.prompt_ids.to_numpy(), tokens.tolist())])
        scaled = logits / params.temperature
        hits += abs(checks.sampling_shape_z(scaled, tokens, params)) > z_max
    return hits / len(attack["batch"].completions)


# 3. fuzz ---------------------------------------------------------------------------------


def fuzz(kit: Kit, n: int):
    params = SamplingParams(temperature=1.0, max_new_tokens=48)
    batch = kit.sample(tasks=4, n=2, params=params)
    recomputed = kit.recompute(batch)
    originals = [c.proof for c in batch.completions]
    rng = random.Random(1)
    reasons, crashes, accepts = Counter(), 0, 0
    t0 = time.perf_counter()
    for i in range(n):
        k = rng.randrange(len(originals))
        data = bytearray(originals[k])
        op = rng.randrange(9)
        if op == 0:  # bit flips
            for _ in range(rng.randrange(1, 4)):
                j = rng.randrange(len(data))
                data[j] ^= 1 << rng.randrange(8)
        elif op == 1:  # a 16-bit word set to an edge value
            j = rng.randrange(len(data) - 1)
            data[j:j + 2] = rng.choice([0, 1, proof.PRIME - 1, proof.PRIME, 65535]).to_bytes(2, "little")
        elif op == 2:
            data = data[:rng.randrange(len(data))]
        elif op == 3:
            data += bytes(rng.randrange(256) for _ in range(rng.randrange(1, 600)))
        elif op == 4:  # a chunk duplicated or dropped
            data = data + data[1:259] if rng.random() < 0.5 else data[:1] + data[259:]
        elif op == 5:
            data = bytearray(rng.randbytes(rng.randrange(0, 2 * len(data))))
        elif op == 6:  # another completion's proof
            data = bytearray(originals[(k + 1) % len(originals)])
        elif op == 7:  # modulus of a chunk zeroed
            j = 1 + 258 * rng.randrange(max(1, (len(data) - 1) // 258))
            data[j:j + 2] = b"\x00\x00"
        else:  # random coefficient rewritten
            j = rng.randrange(1, len(data) - 1)
            data[j:j + 2] = rng.randrange(proof.PRIME).to_bytes(2, "little")
        data = bytes(data)
        try:
            r = proof.verify_proof(data, recomputed[k])
        except Exception:  # noqa: BLE001 - what the benchmark measures
            crashes += 1
            continue
        reasons[r.reason] += 1
        if r.reason == "proof_error":
            crashes += 1
        if r.ok and data != originals[k]:
            accepts += 1
        elif data == originals[k]:
            reasons["(mutation left the proof unchanged)"] += 1
    return n, crashes, accepts, reasons, time.perf_counter() - t0


def toploc_malformed(kit: Kit, workdir: Path):
    params = SamplingParams(temperature=1.0, max_new_tokens=48)
    batch = kit.sample(tasks=1, n=1, params=params)
    h = kit.recompute(batch)[0].numpy()
    mutations = ["modulus0", "short", "extra_chunks", "fewer_chunks", "empty", "random",
                 "bitflip", "bitflip", "bitflip", "bitflip"]
    cases = [{"prover": "h", "verifier": "h", "mutation": m} for m in mutations]
    res = run_toploc(workdir, "malformed", {"h": h}, cases)
    out = []
    for m, r in zip(mutations, res):
        if "crash" in r:
            out.append((m, f"process killed (exit {r['crash']})"))
        else:
            out.append((m, "accepted" if toploc_accepts(r, 0) else "rejected"))
    return out


# 4. costs --------------------------------------------------------------------------------


def costs(kit: Kit, workdir: Path, toploc_ok: bool, repeats: int):
    from swarm_node.node.sampler.hf import HFSampler
    from swarm_node.node.tasks import format_prompt, get_task

    params = SamplingParams(temperature=1.0, max_new_tokens=256)
    sampler = HFSampler(kit.model, kit.tokenizer, peer_id=SENDER, version=VERSION)
    refs = kit.source.draw(SENDER, 999, 2)
    tasks = [get_task(r) for r in refs]
    prompts = [(r, format_prompt(kit.tokenizer, t)) for r, t in zip(refs, tasks)]
    gen_s = build_s = verify_s = proof_verify_s = 0.0
    tokens = 0
    for rep in range(repeats):
        kit.round += 1
        t0 = time.perf_counter()
        groups = sampler.generate(prompts, 4, params)
        gen_s += time.perf_counter() - t0
        samples = [s for g in groups for s in g]
        tokens += sum(len(s.completion_ids) for s in samples)
        t0 = time.perf_counter()
        proof.build_proofs([s.hidden for s in samples])
        build_s += time.perf_counter() - t0
        flat = [t for t, g in zip(tasks, groups) for _ in g]
        batch = attacks.make_batch(flat, samples, swarm_id="bench", round_=999,
                                   policy_id="trainer", policy_version=VERSION, params=params)
        v = kit.verifier()
        t0 = time.perf_counter()
        results = v.verify(batch, SENDER)
        verify_s += time.perf_counter() - t0
        recomputed = kit.recompute(batch)
        t0 = time.perf_counter()
        for c, hh in zip(batch.completions, recomputed):
            proof.verify_proof(c.proof, hh)
        proof_verify_s += time.perf_counter() - t0
        if not all(r.accept for r in results):
            print("cost run: unexpected rejects", Counter(r.reason for r in results))
    micro = []
    g = torch.Generator().manual_seed(0)
    arrays, cases = {}, []
    for t, hsize in ((256, 64), (256, 896), (256, 4096)):
        x = torch.randn(t, hsize, generator=g).to(torch.bfloat16).float()
        reps = 5
        t0 = time.perf_counter()
        for _ in range(reps):
            p = proof.build_proof(x)
        b = (time.perf_counter() - t0) / reps
        t0 = time.perf_counter()
        for _ in range(reps):
            ok = proof.verify_proof(p, x).ok
        v_ = (time.perf_counter() - t0) / reps
        micro.append([t, hsize, b, v_, ok, len(p)])
        key = f"m{t}_{hsize}"
        arrays[key] = x.numpy()
        cases += [{"prover": key, "verifier": key}] * reps
    tl_micro = None
    if toploc_ok:
        res = run_toploc(workdir, "micro", arrays, cases)
        tl_micro = []
        for i, (t, hsize, *_rest) in enumerate(micro):
            recs = res[i * 5:(i + 1) * 5]
            tl_micro.append((sum(r["build_s"] for r in recs) / 5,
                             sum(r["verify_s"] for r in recs) / 5,
                             all(toploc_accepts(r, 0) for r in recs), recs[0]["proof_bytes"]))
    return {"gen_s": gen_s, "build_s": build_s, "verify_s": verify_s,
            "proof_verify_s": proof_verify_s, "tokens": tokens,
            "completions": 8 * repeats}, micro, tl_micro


# main ------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small smoke run; records nothing")
    ap.add_argument("--fuzz", type=int, default=100_000)
    ap.add_argument("--no-toploc", action="store_true")
    ap.add_argument("--real", choices=["float32", "bfloat16"],
                    help="collect honest SmolLM2 verifications in this dtype (verifier_real.py)")
    ap.add_argument("--real-budget-s", type=float, default=1200.0)
    ap.add_argument("--real-cost", choices=["float32", "bfloat16"],
                    help="SmolLM2 cost table: generation vs the baseline verifier vs today's "
                         "on the same batches (verifier_real.cost)")
    ap.add_argument("--real-cost-batches", type=int, default=4)
    ap.add_argument("--real-attacks", choices=["float32", "bfloat16"],
                    help="cheats on SmolLM2 with 8-token completions (verifier_real.attack_run)")
    ap.add_argument("--real-flip-errors", choices=["float32", "bfloat16"],
                    help="honest decode-vs-prefill errors at the verifier's top two "
                         "(verifier_real.flip_errors; budget --real-budget-s)")
    ap.add_argument("--real-steering", choices=["float32"],
                    help="print the fp32 steering study on the flip-error data "
                         "(verifier_real.steering_study; for a hand-written RESULTS section)")
    ap.add_argument("--real-steering-only", default="",
                    help="with --real-steering: only the candidates whose label contains this")
    ap.add_argument("--real-steering-tie-rate", type=float, default=0.0,
                    help="with --real-steering: synthetic near ties per position (0: measured)")
    ap.add_argument("--baseline", default="e83ff02",
                    help="commit whose verifier/checks.py is the cost baseline")
    ap.add_argument("--real-report", metavar="LOAD",
                    help="write the SmolLM2 section from what was collected (LOAD: the load "
                         "average seen during collection, for the record)")
    args = ap.parse_args()
    if args.real or args.real_report or args.real_cost or args.real_attacks \
            or args.real_flip_errors or args.real_steering:
        from benchmarks import verifier_real

        if args.real_steering:
            print(verifier_real.steering_study(args.real_steering,
                                               only=args.real_steering_only,
                                               tie_rate=args.real_steering_tie_rate))
        elif args.real_flip_errors:
            verifier_real.flip_errors(args.real_flip_errors, args.real_budget_s)
        elif args.real_attacks:
            verifier_real.attack_run(args.real_attacks)
        elif args.real_cost:
            verifier_real.cost(args.real_cost, args.real_cost_batches, args.baseline)
        elif args.real:
            verifier_real.collect(args.real, args.real_budget_s)
        else:
            body = verifier_real.report(args.real_report)
            print(body)
            record("verifier-real", body, command="python benchmarks/verifier.py --real "
                   "float32|bfloat16 --real-budget-s N; --real-cost float32 "
                   "--real-cost-batches 5; --real-attacks bfloat16; then --real-report LOAD")
        return
    _imports()
    torch.set_num_threads(1)
    scale = 1 if args.quick else 4
    fuzz_n = 2000 if args.quick else args.fuzz
    why_no_toploc = "disabled (--no-toploc)" if args.no_toploc else toploc_available()
    toploc_ok = why_no_toploc is None
    print("toploc:", "available" if toploc_ok else why_no_toploc, flush=True)
    with tempfile.TemporaryDirectory(prefix="verifier-bench-") as tmp:
        workdir = Path(tmp)
        kit = Kit(workdir)
        t_start = time.perf_counter()
        rows, stats_all, n_honest, tl_honest = run_honest(kit, scale, toploc_ok, workdir)
        print(f"honest: {n_honest} completions ({time.perf_counter() - t_start:.0f} s)", flush=True)
        attack_out, tl_attacks = run_attacks(kit, 4 if args.quick else 16, toploc_ok, workdir)
        print("attacks done", flush=True)
        n_fuzz, crashes, accepts, fuzz_reasons, fuzz_s = fuzz(kit, fuzz_n)
        print(f"fuzz: {n_fuzz} proofs, {crashes} crashes, {accepts} accepts, {fuzz_s:.0f} s",
              flush=True)
        tl_malformed = toploc_malformed(kit, workdir) if toploc_ok else None
        cost, micro, tl_micro = costs(kit, workdir, toploc_ok, 1 if args.quick else 3)
        body = report(rows, stats_all, n_honest, tl_honest, attack_out, tl_attacks, kit,
                      (n_fuzz, crashes, accepts, fuzz_reasons, fuzz_s), tl_malformed, cost,
                      micro, tl_micro, why_no_toploc)
    print(body)
    if not args.quick:
        record("verifier", body, command="python benchmarks/verifier.py")


def report(rows, stats_all, n_honest, tl_honest, attack_out, tl_attacks, kit, fz, tl_malformed,
           cost, micro, tl_micro, why_no_toploc) -> str:
    parts = []
    total = sum(r["n"] for r in rows.values())
    accepted = sum(r["accepted"] for r in rows.values())
    parts.append(f"### 1. Honest variations: {n_honest} honest completions, each verified twice "
                 f"(batched and one-at-a-time prefill): {accepted}/{total} accepted, "
                 f"**{total - accepted} false rejects**\n")
    parts.append(table(["variation", "verifications", "accepted", "rejects"],
                       [[k, r["n"], r["accepted"],
                         ", ".join(f"{a[7:]}={b}" for a, b in r.items() if a.startswith("reject:"))
                         or "-"] for k, r in rows.items()]))

    def worst(key, fn=max):
        vals = [s[key] for s in stats_all if key in s]
        return fn(vals) if vals else float("nan")

    th = checks.CheckSettings()
    parts.append("\nWorst honest value of each statistic against its threshold (float32):\n")
    parts.append(table(["statistic", "worst honest", "threshold"], [
        ["proof: index mismatches per chunk", worst("proof_mismatches"), th.proof.max_mismatches],
        ["proof: mean abs rel. error per chunk", worst("proof_mean_abs"), th.proof.max_mean_abs],
        ["proof: abs bias per chunk", worst("proof_bias"), th.proof.max_bias],
        ["logprob abs diff", worst("logprob_max_diff"), th.logprob_tol],
        ["replay gap (near-tie)", worst("replay_max_gap"), th.tie_eps],
        ["sampling shape abs z", max((abs(s["shape_z"]) for s in stats_all if "shape_z" in s),
                                     default=float("nan")), th.shape_z_max],
        ["EOS probability (min)", worst("eos_prob", min), th.min_eos_prob],
    ]))
    if tl_honest:
        parts.append(f"\ntoploc on the same honest hidden states: {tl_honest[0]}/{tl_honest[1]} "
                     "accepted (reference thresholds).")

    parts.append("\n### 2. Attacks (detection = rejected / submitted)\n")
    rows2 = []
    for k, a in enumerate(attack_out):
        res = a["results"]
        n = len(res)
        rej = sum(not r.accept for r in res)
        why = Counter(r.reason for r in res if not r.accept)
        ours_proof = "-" if a["ours_proof_ok"] is None else \
            f"{sum(not ok for ok in a['ours_proof_ok']) / n:.0%}"
        tl = "n/a (no such check)"
        if tl_attacks is not None and (k, "n") in tl_attacks:
            tl = f"{tl_attacks[(k, 'rejected')] / tl_attacks[(k, 'n')]:.0%}"
        elif why_no_toploc:
            tl = "not run"
        shape = ""
        if a["name"].startswith(("cheap", "greedy", "decode at")):
            shape = f"{shape_detection(kit, a):.0%}"
        passed = [r for r in res if r.accept]
        if passed and a["name"].startswith(("cheap", "greedy", "decode at")):
            # Every token is the real model's seeded choice: the honest rollout itself.
            same = sum(r.stats.get("replay_max_gap", 1) <= 0 for r in passed)
            why[f"accepted: {same} of {len(passed)} token-identical to the honest seeded "
                "sample"] = 0
        rows2.append([a["name"], n, f"{rej / n:.0%}",
                      ", ".join(f"{r}={c}" if c else r for r, c in why.most_common()),
                      ours_proof, tl, shape])
    parts.append(table(["attack", "n", "ours: full verifier", "reasons", "ours: proof only",
                        "toploc: proof only", "shape check alone"], rows2))

    n_fuzz, crashes, accepts, fuzz_reasons, fuzz_s = fz
    parts.append(f"\n### 3. Fuzzed and mutated proofs\n\n{n_fuzz} proofs: **{crashes} crashes, "
                 f"{accepts} accepts** of a changed proof, {fuzz_s / n_fuzz * 1e6:.0f} us per "
                 "verify; verdicts: "
                 + ", ".join(f"{r}={c}" for r, c in fuzz_reasons.most_common()))
    if tl_malformed:
        parts.append("\ntoploc 0.1.6 on malformed proofs (one subprocess each): "
                     + "; ".join(f"{m}: {r}" for m, r in tl_malformed))

    parts.append("\n### 4. Costs\n")
    g = cost
    parts.append(table(["figure", "value"], [
        ["completions x tokens (256 max, tiny model, HF sampler, 1 thread)",
         f"{g['completions']} x {g['tokens'] / g['completions']:.0f}"],
        ["generation time", f"{g['gen_s']:.2f} s"],
        ["proof build time (% of generation)",
         f"{g['build_s'] * 1e3:.1f} ms ({g['build_s'] / g['gen_s']:.2%})"],
        ["full verification time (% of generation)",
         f"{g['verify_s']:.2f} s ({g['verify_s'] / g['gen_s']:.1%})"],
        ["of which proof checks", f"{g['proof_verify_s'] * 1e3:.1f} ms"],
    ]))
    parts.append("\nProof build / verify per token on the same bf16-representable hidden states "
                 "(verify excludes the prefill):\n")
    rows4 = []
    for i, (t, h, b, v, ok, size) in enumerate(micro):
        row = [f"{t} x {h}", f"{b / t * 1e6:.1f}", f"{v / t * 1e6:.1f}", size, ok]
        if tl_micro:
            tb, tv, tok, tsize = tl_micro[i]
            row += [f"{tb / t * 1e6:.1f}", f"{tv / t * 1e6:.1f}", tsize, tok]
        else:
            row += ["-"] * 4
        rows4.append(row)
    parts.append(table(["tokens x hidden", "ours build us/tok", "ours verify us/tok",
                        "ours bytes", "ours accepts", "toploc build us/tok",
                        "toploc verify us/tok", "toploc bytes", "toploc accepts"], rows4))
    if why_no_toploc:
        parts.append(f"\ntoploc: {why_no_toploc}")
    parts.append("\ntoploc cannot prove a chunk with fewer than 128 values (e.g. a 1-token "
                 "last chunk of the 64-dim tiny model): its build returns null proofs and its "
                 "verify aborts the process; such honest cases count as toploc rejects above.")
    load = " -> ".join(f"{a:.1f}" for a in (LOAD_AT_START, os.getloadavg()[0]))
    parts.append("\nvLLM lives in its own venv (.venv-vllm, `make test-vllm`), not in the one "
                 "this benchmark runs in: the HF-vs-vLLM honest variation is not measured "
                 f"here. Timings (wall clock) on 2 cores shared with other jobs, 1-minute load "
                 f"{load}: noisy.")
    return "\n".join(parts)


LOAD_AT_START = os.getloadavg()[0]


if __name__ == "__main__":
    main()
