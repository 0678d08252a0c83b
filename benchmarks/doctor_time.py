"""`swarm-node doctor` wall time (issue 29: goal under 5 s on a loaded 2-core machine), this
tree against a baseline commit, in alternate runs so both see the same load.

The baseline is `git archive <ref>` unpacked as a `swarm_node` package in a temp dir and put
first on PYTHONPATH (ahead of the editable install); both run the same console entry point
with the same HOME, model (builtin:tiny) and interpreter.

    python benchmarks/doctor_time.py --baseline fd0484f --runs 7
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
ENTRY = "import sys; sys.argv = ['swarm-node', 'doctor']; from swarm_node.cli.main import main; main()"


def unpack(ref: str, into: Path) -> Path:
    pkg = into / "swarm_node"
    pkg.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref], capture_output=True,
                             check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(pkg)], input=archive, check=True)
    return into


def one(env: dict) -> float:
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", ENTRY], capture_output=True, text=True,
                          env=env, timeout=300, check=False)
    seconds = time.perf_counter() - t0
    if "recommended on cpu" not in done.stdout:
        raise SystemExit(f"doctor failed: {done.stdout[-500:]} {done.stderr[-1500:]}")
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline", required=True, help="git ref of the code to compare with")
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="doctor-time-") as tmp:
        home = Path(tmp) / "home"
        home.mkdir()
        base = unpack(args.baseline, Path(tmp) / "base")
        envs = {"baseline": {**os.environ, "HOME": str(home), "PYTHONPATH": str(base)},
                "this tree": {**os.environ, "HOME": str(home)}}
        for env in envs.values():  # a first run of each fills the page cache
            one(env)
        times: dict[str, list[float]] = {k: [] for k in envs}
        loads = []
        for _ in range(args.runs):
            for label, env in envs.items():
                loads.append(os.getloadavg()[0])
                times[label].append(one(env))
    from benchmarks.results import table

    rows = [[label, len(ts), f"{statistics.median(ts):.2f}", f"{min(ts):.2f}",
             f"{max(ts):.2f}"] for label, ts in times.items()]
    text = (f"`swarm-node doctor` (builtin:tiny, no --load), {args.runs} alternate runs each; "
            f"baseline {args.baseline}; 1-min load during the runs {min(loads):.1f}-"
            f"{max(loads):.1f}.\n\n"
            + table(["code", "runs", "median s", "min s", "max s"], rows))
    print(text)
    if not args.no_record:
        from benchmarks.results import record

        record("doctor", text)


if __name__ == "__main__":
    main()
