"""A sybil flood on a trainer's verification (issue #30 item 4), measured end to end.

    .venv/bin/python benchmarks/verifier_flood.py [--phase-s 40] [--rounds 3] [--rate 50]

Real `swarm-node join` processes on loopback (tiny model): a trainer and an honest inference
peer (established before the flood), and in this process the flood (node/testing/flood.py):
bogus batches that pass every check before the model runs, each signed by a fresh key,
over 4 connections replaced when cut, at most `--rate` batches per second in all. Phases
of `--phase-s` seconds each:

  baseline   nothing but the swarm;
  control    the attacker does all its work (keys, batches, signatures) but sends nothing:
             what its CPU alone takes from the 2 shared cores;
  flood      the same, sent;
(alternated `--rounds` times: other tenants' load drifts), then
  after      nothing again (recovery).

Per phase: honest completions accepted per second and trainer versions per second (from
the trainer's /status, sampled every second), the honest share against the baseline, the
time after the flood until a 10-s window of honest acceptance is back at 80% of the
baseline, what the trainer spent verifying the flood (its intake's probation seconds) and
what each bogus batch cost the attacker (CPU ms in its own thread) against the trainer
(verification ms). The machine is shared: the load average is recorded.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

BIN = Path(sys.executable).parent / "swarm-node"
SWARM = "floodbench"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    def __init__(self, root: Path, cfg: dict):
        from swarm_node.node.config import dump_toml

        self.root, self.cfg = root, cfg
        root.mkdir(parents=True, exist_ok=True)
        (root / "node.toml").write_text(dump_toml(cfg))
        env = {**os.environ, "HOME": str(root), "OMP_NUM_THREADS": "1",
               "PYTHONUNBUFFERED": "1"}
        self.log = root / "node.log"
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen([str(BIN), "join", "--config", str(root / "node.toml")],
                                         stdout=log, stderr=subprocess.STDOUT, env=env)

    def status(self) -> dict:
        try:
            with urllib.request.urlopen(
                    f"http://127.0.0.1:{self.cfg['admin']['port']}/status", timeout=5) as r:
                return json.loads(r.read())
        except OSError:
            return {}

    def wait(self, pred, timeout: float, what: str):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{what}: exited\n{self.log.read_text()[-2000:]}")
            got = pred()
            if got:
                return got
            time.sleep(0.5)
        raise RuntimeError(f"timed out: {what}\n{self.log.read_text()[-2000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def configs(root: Path, model_dir: Path) -> tuple[dict, dict]:
    shared = {"tasks": {"mix": {"toy/digit_successor": 1.0}, "tasks_per_round": 4},
              "sampler": {"completions_per_task": 4, "max_new_tokens": 8,
                          "batches_per_version": 2}}
    trainer = {"node": {"role": "trainer", "swarm_id": SWARM, "data_dir": str(root / "t"),
                        "listen": ["/ip4/127.0.0.1/tcp/0"]},
               "model": {"name": str(model_dir)}, "admin": {"port": free_port()},
               **shared, "trainer": {"local_items": 4, "external_items": 0,
                                     "peer_batches_per_step": 2, "peer_wait_s": 5.0}}
    peer = {"node": {"role": "inference", "swarm_id": SWARM, "data_dir": str(root / "p"),
                     "listen": ["/ip4/127.0.0.1/tcp/0"]},
            "model": {"name": str(model_dir)}, "admin": {"port": free_port()},
            "tasks": shared["tasks"], "sampler": {**shared["sampler"], "version_wait_s": 5.0}}
    return trainer, peer


async def run(args) -> dict:
    from swarm_node.node.config import Config
    from swarm_node.node.identity import Identity
    from swarm_node.node.models import build_tiny_model, load_model
    from swarm_node.node.sampler.factory import sampling_params
    from swarm_node.node.tasks import TaskSource
    from swarm_node.node.testing import attacks
    from swarm_node.node.testing.flood import GarbageFlood, SybilFlood
    from swarm_node.verifier.rules import batch_rules

    root = Path(args.workdir)
    model_dir = build_tiny_model(root / "model")
    tcfg, pcfg = configs(root, model_dir)
    trainer = Proc(root / "trainer", tcfg)
    peer = None
    try:
        trainer.wait(lambda: "joined swarm" in trainer.log.read_text(), 180, "trainer joined")
        tid = trainer.wait(lambda: trainer.status().get("peer_id"), 60, "trainer status")
        boot = json.loads((Path(tcfg["node"]["data_dir"]) / "node.json").read_text())[
            "listen_addrs"][0]
        pcfg["node"].update(bootstrap=[boot], follow=[tid])
        peer = Proc(root / "peer", pcfg)
        hid = peer.wait(lambda: peer.status().get("peer_id"), 180, "peer up")

        def sample() -> tuple[float, int, int, dict, float]:
            st = trainer.status()
            acc = (st.get("accepted_by_peer") or {}).get(hid, {}).get("accepted", 0)
            intake = (st.get("extra") or {}).get("intake") or {}
            return (time.monotonic(), acc, st.get("policy_version", 0), intake,
                    process_cpu(trainer.proc.pid))

        trainer.wait(lambda: sample()[1] >= 64, 300, "honest peer established")
        swarm = Config.model_validate({"tasks": tcfg["tasks"], "sampler": tcfg["sampler"],
                                       "node": {"swarm_id": SWARM,
                                                "listen": ["/ip4/127.0.0.1/tcp/0"]}})
        model, tokenizer = load_model(model_dir)
        source = TaskSource(swarm.tasks.mix, SWARM)
        rules, params = batch_rules(swarm), sampling_params(swarm)
        rng = random.Random(0)
        version = [0]

        def make_batch(sender: str, v: int):
            return attacks.bogus_round(tokenizer, source, sender, round_=rules.round_for(v, 0),
                                       version=v, tasks=rules.tasks_per_round,
                                       n=rules.completions_per_task, params=params,
                                       hidden_size=model.config.hidden_size, rng=rng,
                                       policy_id=tid, swarm_id=SWARM,
                                       length=params.max_new_tokens)

        samples: list[tuple[str, tuple]] = []

        async def phase(name: str, flood, dry: bool = False) -> dict:
            stop = asyncio.Event()
            tasks = []
            if flood is not None and not dry:
                tasks.append(asyncio.ensure_future(flood.run(stop)))
            spy = profile(args, trainer.proc.pid, name)
            first = sample()
            cpu0 = process_cpu(trainer.proc.pid)
            threads0 = thread_cpu(trainer.proc.pid)
            t_end = time.monotonic() + args.phase_s
            built = 0
            while time.monotonic() < t_end:
                s = sample()
                version[0] = s[2]
                samples.append((name, s))
                if dry and not args.garbage:  # the attacker's own work, not sent
                    t1 = time.monotonic() + 1.0
                    while time.monotonic() < t1:
                        sybil = Identity.generate()
                        sybil.seal(make_batch(sybil.peer_id, version[0]))
                        built += 1
                        await asyncio.sleep(1.0 / args.rate)
                else:
                    await asyncio.sleep(1.0)
            stop.set()
            for t in tasks:
                await t
            if spy is not None:
                spy.wait()
            last = sample()
            cpu1 = process_cpu(trainer.proc.pid)
            threads1 = thread_cpu(trainer.proc.pid)
            dt = last[0] - first[0]
            spent = (last[3].get("verify_seconds", {}).get("probation", 0.0)
                     - first[3].get("verify_seconds", {}).get("probation", 0.0))
            verified = (last[3].get("batches", {}).get("probation", 0)
                        - first[3].get("batches", {}).get("probation", 0))
            return {"phase": name, "seconds": dt, "honest_per_s": (last[1] - first[1]) / dt,
                    "versions_per_s": (last[2] - first[2]) / dt, "probation_s": spent,
                    "probation_batches": verified, "built": built,
                    "trainer_cpu_s": cpu1 - cpu0,
                    "max_gap_s": training_gap([s for n, s in samples if n == name] + [last]),
                    "threads_cpu_s": {k: round(v - threads0.get(k, 0.0), 2)
                                      for k, v in threads1.items()
                                      if v - threads0.get(k, 0.0) >= 0.05}}

        # alternated rounds (the machine is shared: other tenants' load drifts), then after
        out, floods = [], []
        for r in range(args.rounds):
            out.append(await phase(f"baseline {r + 1}", None))
            out.append(await phase(f"control {r + 1}", SybilFlood(
                swarm, boot, tid, make_batch, lambda: version[0]), dry=True))
            if args.garbage:  # garbage on every protocol, from fresh identities
                flood = GarbageFlood(swarm, boot, tid, connections=8, interval_s=8.0 / args.rate)
            else:
                flood = SybilFlood(swarm, boot, tid, make_batch, lambda: version[0],
                                   connections=4, interval_s=4.0 / args.rate)
            floods.append(flood)
            out.append(await phase(f"flood {r + 1}", flood))
        flood_end = time.monotonic()
        out.append(await phase("after", None))
        last_base = out[-4]  # the last round's baseline
        base = last_base["honest_per_s"]
        base_cpu = last_base["honest_per_s"] * last_base["seconds"] / max(
            last_base["trainer_cpu_s"], 1e-9)
        # recovery: first 10-s window after the flood with honest acceptance >= 80% of base:
        # per second (what a user sees; other tenants' load moves it too), and per trainer
        # CPU-second (what the flood left behind in the trainer, whatever the tenants do)
        after = [s for name, s in samples if name == "after"]

        def recovered(rate_of, target: float) -> float | None:
            for i, s in enumerate(after):
                j = next((k for k in range(i, len(after)) if after[k][0] - s[0] >= 10.0),
                         None)
                if j is None:
                    return None
                if rate_of(s, after[j]) >= 0.8 * target:
                    return s[0] - flood_end
            return None

        recovery = recovered(lambda a, b: (b[1] - a[1]) / (b[0] - a[0]), base)
        recovery_cpu = recovered(lambda a, b: (b[1] - a[1]) / max(b[4] - a[4], 1e-9), base_cpu)
        sent = sum(getattr(f, "sent", 0) or getattr(f, "streams", 0) for f in floods)
        return {"phases": out, "flood": {
            "sent": sent, "carriers": sum(f.carriers for f in floods),
            "cut": sum(f.cut for f in floods),
            "attacker_ms": sum(getattr(f, "cpu_s", 0.0) for f in floods) / max(1, sent) * 1e3,
            "refused": sum(getattr(f, "refused", 0) for f in floods)},
            "recovery_s": recovery, "recovery_cpu_s": recovery_cpu,
            "trainer_rss_mib": _rss(trainer.proc.pid)}
    finally:
        if peer is not None:
            peer.stop()
        trainer.stop()


def training_gap(samples: list[tuple]) -> float:
    """The longest time in a phase's samples (time, _, policy version, ...) without a new
    trainer version (from the phase's start, to its end)."""
    if len(samples) < 2:
        return 0.0
    gap, since = 0.0, samples[0][0]
    for prev, cur in itertools.pairwise(samples):
        if cur[2] > prev[2]:
            gap, since = max(gap, cur[0] - since), cur[0]
    return max(gap, samples[-1][0] - since)


def profile(args, pid: int, phase: str):
    """py-spy over the trainer process for the phase (`--profile DIR`: collapsed stacks per
    thread, DIR/<phase>.txt), or None."""
    if not args.profile:
        return None
    out = Path(args.profile) / f"{phase.replace(' ', '-')}.txt"
    out.parent.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen([args.py_spy, "record", "-p", str(pid), "-d",
                             str(max(1, int(args.phase_s) - 2)), "-r", "50", "--threads", "--gil",
                             "-f", "raw", "-o", str(out), "--nonblocking"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def process_cpu(pid: int) -> float:
    """CPU seconds (user + system) of process `pid` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds so far of each thread of process `pid`, by thread id (the ids py-spy
    names in `--profile` output)."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[task.name] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return out


def _rss(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def report(res: dict, load: str, args) -> str:
    import statistics

    from benchmarks.results import table

    phases = res["phases"]
    rows = []
    for p in phases:
        per_cpu = p["honest_per_s"] * p["seconds"] / max(p["trainer_cpu_s"], 1e-9)
        rows.append([p["phase"], f"{p['seconds']:.0f}", f"{p['honest_per_s']:.2f}",
                     f"{p['versions_per_s']:.3f}", f"{p['trainer_cpu_s']:.1f}",
                     f"{per_cpu:.0f}", p["probation_batches"], f"{p['probation_s']:.1f}"])

    def ratio(kind: str, key) -> list[float]:
        out = []
        for i in range(0, len(phases) - 1, 3):
            b, x = phases[i], phases[i + {"control": 1, "flood": 2}[kind]]
            if key(b) > 0:
                out.append(key(x) / key(b))
        return out

    def per_cpu(p):
        return p["honest_per_s"] * p["seconds"] / max(p["trainer_cpu_s"], 1e-9)

    f = res["flood"]
    fl = [p for p in phases if p["phase"].startswith("flood")]
    verified = sum(p["probation_batches"] for p in fl)
    spent = sum(p["probation_s"] for p in fl)
    seconds = sum(p["seconds"] for p in fl)
    med = {k: statistics.median(ratio(*k)) for k in
           [("control", lambda p: p["honest_per_s"]), ("flood", lambda p: p["honest_per_s"]),
            ("flood", per_cpu)]}
    vals = list(med.values())
    text = [(f"Load average: {load} (2 shared cores, other tenants' jobs running). Tiny model; "
             "trainer `peer_batches_per_step = 2` (as in earlier runs, for comparison); "
             "honest peer: 4 tasks x 4 completions x 8 tokens, 2 rounds per version. "
             + (f"Flood: garbage (1-4096 random bytes per stream) on every protocol the "
                f"trainer serves, at most {args.rate:.0f} streams/s over 8 connections, each "
                "from a fresh identity, replaced when cut. " if args.garbage else
                f"Flood: at most {args.rate:.0f} bogus batches/s over 4 connections, a fresh "
                "key per batch. ")
             + f"{args.rounds} alternated rounds of baseline / control "
             + ("(nothing sent)" if args.garbage else "(the attacker's CPU work, nothing sent)")
             + f" / flood, {args.phase_s:.0f} s each, then `after`.\n"),
            table(["phase", "seconds", "honest completions accepted / s",
                   "trainer versions / s", "trainer CPU s",
                   "honest completions per trainer CPU-s", "flood batches verified",
                   "verification s spent on them"], rows),
            "",
            (f"- honest acceptance against the same round's baseline (median of "
            f"{args.rounds}): control {vals[0]:.0%}, **flood {vals[1]:.0%}**; honest "
            f"completions per trainer CPU-second under the flood: {vals[2]:.0%} of the "
            "baseline's (what the flood takes of the trainer's own CPU, whatever the other "
            "tenants do)."),
            *([(f"- garbage: {f['sent']} streams opened over {f['carriers']} carriers "
                f"({f['cut']} cut), {f['refused']} opens or writes refused.")]
              if args.garbage else [
            (f"- flood: {f['sent']} bogus batches sent over {f['carriers']} carriers "
             f"({f['cut']} cut); {verified} reached the model checks "
             f"({verified / max(1, f['sent']):.1%}), in {spent:.1f} s of the flood phases' "
             f"{seconds:.0f} s ({spent / max(seconds, 1e-9):.0%}); the rest expired in the "
             "probation queue."),
            (f"- cost per bogus batch: attacker {f['attacker_ms']:.1f} ms CPU (a key, a "
             f"batch, two signatures); trainer {spent / max(1, verified) * 1e3:.0f} ms of "
             f"verification for each one it verified, {spent / max(1, f['sent']) * 1e3:.1f} "
             "ms per batch sent.")]),
            "- longest training gap (no new trainer version) per phase: "
            + ", ".join(f"{p['phase']} {p['max_gap_s']:.1f} s" for p in phases),
            "- recovery: honest acceptance back at >= 80% of the last baseline (10-s window) "
            + (f"{res['recovery_s']:.1f} s after the flood stopped"
               if res["recovery_s"] is not None else "not within the after phase")
            + "; per trainer CPU-second (honest completions per trainer CPU-s at >= 80% of the "
            "last baseline's, 10-s window) "
            + (f"{res['recovery_cpu_s']:.1f} s after"
               if res.get("recovery_cpu_s") is not None else "not within the after phase"),
            f"- trainer RSS at the end: {res['trainer_rss_mib']:.0f} MiB"]
    return "\n".join(text)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--phase-s", type=float, default=40.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rate", type=float, default=50.0)
    ap.add_argument("--workdir", default="/tmp/verifier-flood")
    ap.add_argument("--no-record", action="store_true")
    ap.add_argument("--garbage", action="store_true",
                    help="the flood is garbage on every protocol the trainer serves (issue 30 "
                    "item 13: 8 connections, fresh identities, --rate streams/s in all); "
                    "control = nothing sent; recorded as section verifier-garbage")
    ap.add_argument("--profile", default="", help="py-spy the trainer: collapsed stacks "
                    "per phase into this folder")
    ap.add_argument("--py-spy", default="py-spy", help="the py-spy executable")
    args = ap.parse_args()
    load = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    res = asyncio.run(run(args))
    load += " -> " + " / ".join(f"{x:.1f}" for x in os.getloadavg())
    text = report(res, load, args)
    print(text)
    print(json.dumps(res, indent=1))
    if not args.no_record:
        from benchmarks.results import record

        record("verifier-garbage" if args.garbage else "verifier-flood", text)


if __name__ == "__main__":
    main()
