"""Runs the `toploc` 0.1.6 package for benchmarks/verifier.py, inside .venv-toploc.

Usage: python toploc_worker.py JOB.json OUT.jsonl START
JOB = {"npz": path, "cases": [{"prover": key, "verifier": key, "mutation": str|null}, ...]}.
For each case from START on, builds toploc proofs from the prover's hidden states (bf16,
32 tokens per chunk, top-128, C++ path), optionally mutates them, verifies them against the
verifier's hidden states, and appends one JSON line. toploc can kill the process on
malformed proofs; the parent then restarts after the last line written.
"""

from __future__ import annotations

import json
import random
import sys
import time

import numpy as np
import toploc
import torch

CHUNK, TOPK = 32, 128


def mutate(proofs: list[bytes], how: str, rng: random.Random) -> list[bytes]:
    if how == "modulus0":
        return [b"\x00\x00" + p[2:] for p in proofs]
    if how == "short":
        return [p[: len(p) // 2] for p in proofs]
    if how == "extra_chunks":
        return proofs + proofs
    if how == "fewer_chunks":
        return proofs[:-1]
    if how == "empty":
        return []
    if how == "random":
        return [bytes(rng.randrange(256) for _ in range(len(p))) for p in proofs]
    if how == "bitflip":
        out = []
        for p in proofs:
            b = bytearray(p)
            i = rng.randrange(len(b))
            b[i] ^= 1 << rng.randrange(8)
            out.append(bytes(b))
        return out
    raise ValueError(how)


def main() -> None:
    with open(sys.argv[1]) as f:
        job = json.load(f)
    with open(sys.argv[2], "a") as out:
        run(job, out, int(sys.argv[3]))


def run(job: dict, out, start: int) -> None:
    torch.set_num_threads(1)
    arrays = np.load(job["npz"])
    warm = torch.randn(64, 64).to(torch.bfloat16)  # first-call costs stay out of the timings
    toploc.verify_proofs_bytes(warm, toploc.build_proofs_bytes(warm, CHUNK, TOPK, skip_prefill=True),
                               CHUNK, TOPK, skip_prefill=True)
    for n, case in enumerate(job["cases"][start:], start):
        prover = torch.from_numpy(arrays[case["prover"]]).to(torch.bfloat16)
        verifier = torch.from_numpy(arrays[case["verifier"]]).to(torch.bfloat16)
        t0 = time.perf_counter()
        proofs = toploc.build_proofs_bytes(prover, CHUNK, TOPK, skip_prefill=True)
        t1 = time.perf_counter()
        if case.get("mutation"):
            proofs = mutate(proofs, case["mutation"], random.Random(n))
        t2 = time.perf_counter()
        results = toploc.verify_proofs_bytes(verifier, proofs, CHUNK, TOPK, skip_prefill=True)
        t3 = time.perf_counter()
        chunks = [[r.exp_mismatches, r.mant_err_mean, r.mant_err_median] for r in results]
        out.write(json.dumps({"i": n, "build_s": t1 - t0, "verify_s": t3 - t2,
                              "proof_bytes": sum(len(p) for p in proofs), "chunks": chunks})
                  + "\n")
        out.flush()


if __name__ == "__main__":
    main()
