"""Sequential tests across identities (issue #30 items 7 and 8): honest false alarms and
what steering and bias cheats cost, for the per-peer CUSUMs, the one-batch test of senders
without history and the pooled test over them (verifier/sequential.py), on honest
per-completion statistics measured with the real verifier.

    # honest completions on the tiny model (each appends one JSON line per completion)
    .venv/bin/python benchmarks/verifier_ties.py --collect-tiny bfloat16 --budget-s 300
    .venv/bin/python benchmarks/verifier_ties.py --collect-tiny float32 --budget-s 300
    # SmolLM2: benchmarks/verifier.py --real bfloat16 (VERIFIER_REAL_OUT, the same format)
    # the report, into RESULTS.md section "verifier-ties"
    .venv/bin/python benchmarks/verifier_ties.py --report LOAD

The report resamples honest completions into batches (a bootstrap, as verifier_real.py's)
and feeds them to the real `PeerMonitor.observe_batch`: established peers (their own
CUSUMs), and newcomers without history interleaved (each one batch; the one-batch test and
the pooled cohort see all of them). Cheats are applied to the same honest statistics: a
steered tie toggles whether the claimed token is the verifier's best (taking the runner-up
where the honest token was the best, or the best where honest floats had reordered them);
a bias shifts the logprob error sum. Figures: false alarms per batch, batches to the
alarm, the share of positions a cheat controls before it is caught, and honest newcomers
blamed with a pooled alarm.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

OUT = Path(os.environ.get("VERIFIER_TIES_OUT", "/tmp/verifier-ties"))
REAL_OUT = Path(os.environ.get("VERIFIER_REAL_OUT", "/tmp/verifier-real"))
MIX = {"toy/digit_successor": 1.0, "toy/digit_copy": 1.0}
SENDER = "12D3KooWBenchTiesPeer"


def collect_tiny(dtype: str, budget_s: float) -> Path:
    """Honest batches (4 tasks x 8, 16 tokens, T = 1) of the built-in tiny model, sampled
    and verified in `dtype` with loose thresholds (every statistic kept)."""
    import torch
    from swarm_node.node.models import build_tiny_model, load_model
    from swarm_node.node.tasks import TaskSource
    from swarm_node.node.testing import attacks
    from swarm_node.protocol.messages import SamplingParams
    from swarm_node.verifier.checks import RolloutVerifier

    from benchmarks.verifier_real import loose_settings

    torch.set_num_threads(1)
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / f"tiny-{dtype}.jsonl"
    model, tokenizer = load_model(build_tiny_model(OUT / "tiny-model"), dtype=dtype)
    source = TaskSource(MIX, "default")
    params = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=16)
    v = RolloutVerifier(model, tokenizer, source, swarm_id="default",
                        latest_version=lambda: 0, dtype=dtype, settings=loose_settings())
    round_ = int(time.time())
    t_end = time.monotonic() + budget_s
    with open(path, "a") as out:
        while time.monotonic() < t_end:
            batch = attacks.sample_batch(model, tokenizer, source, SENDER, round_=round_,
                                         version=0, tasks=4, n=8, params=params)
            batch = batch.model_copy(update={"dtype": dtype})
            out.writelines(json.dumps({"dtype": dtype, "variation": "tiny, batch 32, T=1",
                                      "reason": r.reason, "stats": r.stats,
                                      "len": c.completion_ids.shape[0]}) + "\n" for r, c in zip(v.verify(batch, SENDER), batch.completions))
            round_ += 1
    return path


def load(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [r for r in (json.loads(line) for line in path.read_text().splitlines()
                        if line.strip()) if r["reason"] == "ok"]


def datasets() -> list[tuple[str, str, list[dict]]]:
    """(label, dtype, honest records) for each data set on disk."""
    out = []
    for label, dtype, path in (("SmolLM2 bf16", "bfloat16", REAL_OUT / "bfloat16.jsonl"),
                               ("SmolLM2 fp32", "float32", REAL_OUT / "float32.jsonl"),
                               ("tiny bf16", "bfloat16", OUT / "tiny-bfloat16.jsonl"),
                               ("tiny fp32", "float32", OUT / "tiny-float32.jsonl")):
        recs = load(path)
        if recs:
            out.append((label, dtype, recs))
    return out


# the statistics a cheat changes ------------------------------------------------------------


def _stats(rec: dict, rng, steer_wide: float = 0.0, steer_narrow: float = 0.0,
           bias: float = 0.0, tie_eps: float = 1.0) -> tuple[dict, int, int]:
    """`rec`'s stats with a cheat applied: each wide tie (margin > tie_eps / 4) steered with
    probability `steer_wide`, each narrow one with `steer_narrow` (a steered tie toggles
    `tie_flipped`), logprob errors shifted by `bias` per token. Returns (stats, positions
    steered, positions)."""
    st = rec["stats"]
    # collected with a loose tie_eps: only margins within the real one are ties
    pairs = [(m, f) for m, f in zip(st.get("tie_margins", []), st.get("tie_flipped", []))
             if m <= tie_eps]
    margins, flipped = [m for m, _ in pairs], [bool(f) for _, f in pairs]
    steered = 0
    if steer_wide or steer_narrow:
        for k, m in enumerate(margins):
            p = steer_wide if m > tie_eps / 4 else steer_narrow
            if p and rng.random() < p:
                flipped[k] = not flipped[k]
                steered += 1
    out = {"lp_err_sum": st.get("lp_err_sum", 0.0) + bias * st.get("lp_n", 0.0),
           "lp_n": st.get("lp_n", 0.0), "tie_margins": margins, "tie_flipped": flipped}
    if "replay_max_gap" in st:
        out["replay_outliers"] = float(st["replay_max_gap"] > tie_eps)
    return out, steered, rec["len"]


def honest_rates(recs: list[dict], settings, batch: int, batches: int, newcomers: bool,
                 seed: int = 0) -> dict:
    """False alarms on `batches` honest batches: established peers (100 of them, their own
    CUSUMs) or newcomers (one batch each, probation: the one-batch and pooled tests too)."""
    import numpy as np
    from swarm_node.verifier.sequential import PeerMonitor

    rng = np.random.default_rng(seed)
    pool = [_stats(r, rng, tie_eps=settings.tie_eps or 1.0)[0] for r in recs]  # honest: fixed
    mon = PeerMonitor(settings)
    alarms: dict[str, int] = {}
    for b in range(batches):
        peer = f"new{b}" if newcomers else f"est{b % 100}"
        picks = rng.integers(len(pool), size=batch)
        alarm = mon.observe_batch(peer, [pool[k] for k in picks], probation=newcomers)
        if alarm is not None:
            alarms[alarm.test] = alarms.get(alarm.test, 0) + 1
    return {"batches": batches, "alarms": alarms, "total": sum(alarms.values())}


def sybils(recs: list[dict], settings, batch: int, n_sybils: int, honest_between: int,
           cheat: dict, trials: int = 100, seed: int = 1) -> dict:
    """Item 7: `n_sybils` fresh identities each send ONE cheating batch, with
    `honest_between` honest newcomers' batches before each (all on probation). Per trial:
    how many sybil batches were condemned (by any test), how many honest newcomers were
    blamed, and the share of positions the uncaught sybil batches steered."""
    import numpy as np
    from swarm_node.verifier.sequential import PeerMonitor

    rng = np.random.default_rng(seed)
    caught = blamed = steered_free = positions_free = 0
    for t in range(trials):
        mon = PeerMonitor(settings)
        for s in range(n_sybils):
            for h in range(honest_between):
                picks = rng.integers(len(recs), size=batch)
                stats = [_stats(recs[k], rng, tie_eps=settings.tie_eps)[0] for k in picks]
                a = mon.observe_batch(f"h{t}-{s}-{h}", stats, probation=True)
                if a is not None:
                    blamed += sum(1 for p in a.peers if p.startswith("h"))
            picks = rng.integers(len(recs), size=batch)
            done = [_stats(recs[k], rng, tie_eps=settings.tie_eps, **cheat) for k in picks]
            a = mon.observe_batch(f"s{t}-{s}", [d[0] for d in done], probation=True)
            if a is not None and f"s{t}-{s}" in a.peers:
                caught += 1
            else:
                steered_free += sum(d[1] for d in done)
                positions_free += sum(d[2] for d in done)
            if a is not None:
                blamed += sum(1 for p in a.peers if p.startswith("h"))
                caught += sum(1 for p in a.peers
                              if p.startswith("s") and p != f"s{t}-{s}")  # earlier sybils
    total = trials * n_sybils
    return {"caught": min(caught, total), "total": total, "blamed": blamed,
            "steered_share": steered_free / max(1, positions_free)}


def persistent(recs: list[dict], settings, batch: int, cheat: dict, established: bool,
               cheaters: int = 100, horizon: int = 200, seed: int = 2) -> dict:
    """Item 8: one identity keeps cheating, batch after batch; batches to its alarm
    (median / 95th percentile), and the share of positions it steered before the alarm."""
    import numpy as np
    from swarm_node.verifier.sequential import PeerMonitor

    rng = np.random.default_rng(seed)
    delays, steered, positions = [], 0, 0
    for c in range(cheaters):
        mon = PeerMonitor(settings)
        first = None
        for b in range(horizon):
            picks = rng.integers(len(recs), size=batch)
            done = [_stats(recs[k], rng, tie_eps=settings.tie_eps, **cheat) for k in picks]
            a = mon.observe_batch(f"c{c}", [d[0] for d in done], probation=not established)
            if a is not None:
                first = b + 1
                break
            steered += sum(d[1] for d in done)
            positions += sum(d[2] for d in done)
        delays.append(first if first is not None else math.inf)
    delays.sort()
    fin = [d for d in delays if d < math.inf]
    p95 = delays[int(0.95 * (len(delays) - 1))]
    return {"median": delays[len(delays) // 2], "p95": p95, "never": len(delays) - len(fin),
            "steered_share": steered / max(1, positions)}


def _synthetic(rng, wide: int = 6, narrow: int = 2, p_wide: float = 0.04,
               p_narrow: float = 0.25, steered: int = 0) -> dict:
    """bf16 stats of one honest completion at the measured rates (wide ties flip 3.6-4%,
    narrow 24-25%: the tables below), plus `steered` narrow ties taken flipped."""
    wf = [rng.random() < p_wide for _ in range(wide)]
    nf = [rng.random() < p_narrow for _ in range(narrow)] + [True] * steered
    return {"tie_margins": [0.3] * wide + [0.05] * len(nf), "tie_flipped": wf + nf}


def reprobation(head_starts, trials: int, batch: int = 8, needs: int = 64,
                steered=(5, 8, 11), seed: int = 3) -> list[list]:
    """Issue 30 (newcomers item 4): what the head start of a condemned peer's tests costs.
    Honest: a peer put back on probation by a false alarm sends `needs` completions (its
    re-probation, reputation.py 8 x 8) at the measured honest bf16 rates; the share of
    such probations that alarm again (which bans it). Steerer: a condemned peer sends one
    honest batch, then one with `k` steered narrow ties spread over it; the share caught
    by that batch (its own tests, the one-batch test; no pooled cohort)."""
    import random

    from swarm_node.verifier.sequential import PeerMonitor, SequentialSettings

    rows = []
    for hs in head_starts:
        s = SequentialSettings(**{**SequentialSettings.for_dtype("bfloat16").__dict__,
                                  "head_start": hs, "pooled": False})
        rng = random.Random(seed)
        again = 0
        for _ in range(trials):
            m = PeerMonitor(s)
            m.condemned("p")
            for _ in range(needs // batch):
                if m.observe_batch("p", [_synthetic(rng) for _ in range(batch)], True):
                    again += 1
                    break
        caught = []
        for k in steered:
            hit = 0
            for _ in range(trials // 4):
                m = PeerMonitor(s)
                m.condemned("c")
                m.observe_batch("c", [_synthetic(rng) for _ in range(batch)], True)
                comps = [_synthetic(rng, steered=k // batch + (i < k % batch))
                         for i in range(batch)]
                hit += m.observe_batch("c", comps, True) is not None
            caught.append(f"{hit / (trials // 4):.0%}")
        rows.append([hs, f"{again / trials:.2%} ({again} / {trials})", *caught])
    return rows


def tie_table(recs: list[dict], tie_eps: float) -> list[list]:
    edges = [1 / 64, 1 / 16, 1 / 4, 1.0]
    rows = []
    lo = 0.0
    positions = sum(r["len"] for r in recs)
    for e in edges:
        ties = flips = 0
        for r in recs:
            for m, f in zip(r["stats"].get("tie_margins", []), r["stats"].get("tie_flipped", [])):
                if lo * tie_eps < m <= e * tie_eps:
                    ties += 1
                    flips += bool(f)
        rows.append([f"({lo * tie_eps:.3g}, {e * tie_eps:.3g}]", ties,
                     f"{ties / max(1, positions):.2%}", flips,
                     f"{flips / ties:.3f}" if ties else "-"])
        lo = e
    return rows


def report(load_avg: str, batches: int) -> str:
    from swarm_node.verifier.checks import CheckSettings
    from swarm_node.verifier.sequential import SequentialSettings

    from benchmarks.results import table

    parts = [(f"Load average during the run: {load_avg}. Honest statistics: completions "
             "verified by the real `RolloutVerifier` with loose thresholds (every statistic "
             "kept); resampled into batches of 32 for the real `PeerMonitor.observe_batch` "
             f"with `SequentialSettings.for_dtype`. {batches:,} honest batches per row.\n")]
    for label, dtype, recs in datasets():
        s = SequentialSettings.for_dtype(dtype)
        tie_eps = CheckSettings.for_dtype(dtype).tie_eps
        parts.append(f"### {label}: {len(recs)} honest completions, "
                     f"{sum(r['len'] for r in recs)} positions\n")
        parts.append(table(["tie margin", "ties", "of positions", "honest flips",
                            "flip rate"], tie_table(recs, tie_eps)))
        parts.append("")
        rows = []
        for who, newcomers in (("established peers (own CUSUMs)", False),
                               ("newcomers, one batch each (+ one-batch and pooled tests)",
                                True)):
            r = honest_rates(recs, s, 32, batches, newcomers)
            bound = f"< {3 / batches:.1e} (95%)" if r["total"] == 0 else \
                f"{r['total'] / batches:.1e}"
            rows.append([who, batches, f"**{r['total']}** {r['alarms'] or ''}", bound])
        parts.append(table(["honest", "batches", "false alarms (by test)", "per batch"], rows))
        parts.append("")
        cheats = [("steer every tie (wide and narrow)", {"steer_wide": 1.0, "steer_narrow": 1.0}),
                  ("steer every narrow tie, a quarter of the wide ones",
                   {"steer_wide": 0.25, "steer_narrow": 1.0}),
                  ("steer half the narrow ties", {"steer_narrow": 0.5}),
                  ((f"logprob bias {-0.05 * CheckSettings.for_dtype(dtype).logprob_tol:+.3g}"
                   "/token"), {"bias": -0.05 * CheckSettings.for_dtype(dtype).logprob_tol})]
        rows = []
        for name, cheat in cheats:
            for n, between in ((3, 0), (3, 10)):
                r = sybils(recs, s, 32, n, between, cheat)
                rows.append([name, (f"{n} sybils x 1 batch, {between} honest newcomer "
                                   "batches before each"),
                             f"{r['caught']} of {r['total']}", r["blamed"],
                             f"{r['steered_share']:.2%}"])
        parts.append(table(["cheat", "item 7: sybils", "sybil batches condemned",
                            "honest newcomers blamed", ("positions steered in uncaught "
                            "batches")], rows))
        parts.append("")
        rows = []
        for name, cheat in cheats:
            for est in (False, True):
                r = persistent(recs, s, 32, cheat, est)
                rows.append([name, "established" if est else "new",
                             f"{r['median']} / {r['p95']}", r["never"],
                             f"{r['steered_share']:.2%}"])
        parts.append(table(["cheat", "item 8: one identity", ("batches to alarm: median / "
                            "95th"), "never caught in 200", ("positions steered before the "
                            "alarm")], rows))
        parts.append("")
    return "\n".join(parts)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--collect-tiny", choices=["float32", "bfloat16"])
    ap.add_argument("--budget-s", type=float, default=300.0)
    ap.add_argument("--report", metavar="LOAD")
    ap.add_argument("--batches", type=int, default=40_000)
    ap.add_argument("--no-record", action="store_true")
    ap.add_argument("--reprobation", type=int, metavar="TRIALS",
                    help="head start sweep (synthetic bf16 rates): honest re-alarms over a "
                         "re-probation, weak steering caught; prints a table")
    args = ap.parse_args()
    if args.reprobation:
        from benchmarks.results import table

        print(table(["head_start", "honest re-alarm over 64 completions",
                     "5 steered narrow ties caught", "8", "11"],
                    reprobation((0.3, 0.4, 0.45, 0.5, 0.55, 0.6), args.reprobation)))
    if args.collect_tiny:
        print(collect_tiny(args.collect_tiny, args.budget_s))
    if args.report is not None:
        from benchmarks.results import record

        text = report(args.report, args.batches)
        print(text)
        if not args.no_record:
            record("verifier-ties", text)


if __name__ == "__main__":
    main()
