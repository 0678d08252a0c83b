"""Checkpoint broadcast on loopback: ours vs shardcast 0.3.2, in the same run.

One origin, one relay (shardcast: middle node), N clients, one checkpoint (default 256 MiB).
Figures: time from publish until every client holds a verified copy, aggregate throughput
(client copies delivered per second), peak RSS per client, and bytes re-fetched when the
relay serves one corrupted shard.

    .venv/bin/python -m benchmarks.broadcast [--mib 256] [--clients 4]

shardcast runs under its own venv (.venv-shardcast: `pip install shardcast==0.3.2 blake3`)
through benchmarks/shardcast_peer.py, bound to 127.0.0.1, middle-node poll interval 1 s
(its default is 30 s), default 50 MB shards; clients start (and poll) before the publish.
Ours: default config (4 MiB shards; shards over the bulk plane: TLS 1.3 beside libp2p,
authenticated by peer ids, the default), and once with `bulk.listen = "off"` (libp2p
streams: Noise + Yamux through the trio bridge, the NAT fallback); clients bootstrap through the relay; any peer that verified a shard may serve it,
so the notes show where the clients' bytes came from. The corrupted-shard case makes the
relay flip one byte of the first shard it serves (and of every later copy of that shard).
Peak RSS is VmHWM of each client process.

`--repeat N` runs the default path and shardcast N times each per client count, alternated
(ours, shardcast, ours, ...), and the table shows each one's median with every run listed:
on this VM a run's time depends on how much warm memory the guest holds (see the page-cache
probe), and alternating gives both systems the same share of it. Each default-path swarm
also takes a second version of the same size once the first is verified everywhere (the
steady state of a training run: peers connected, mesh built, bulk connections open), reported
beside the first (`--skip-next` leaves it out); shardcast is run for one version only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


from swarm_node.node.config import P2PSection

from benchmarks.results import Headline, record, table
from tests.node.broadcast.procs import BroadcastProc

ROOT = Path(__file__).resolve().parents[1]
SHARDCAST_PY = ROOT / ".venv-shardcast" / "bin" / "python"
SHARDCAST_PEER = Path(__file__).with_name("shardcast_peer.py")
MiB = 2**20


def same_file(a: Path, b: Path) -> bool:
    if a.stat().st_size != b.stat().st_size:
        return False
    with open(a, "rb") as fa, open(b, "rb") as fb:
        while True:
            x, y = fa.read(MiB), fb.read(MiB)
            if x != y:
                return False
            if not x:
                return True


def make_checkpoint(path: Path, mib: int) -> Path:
    path.mkdir(parents=True)
    with open(path / "model.safetensors", "wb") as f:
        f.writelines(os.urandom(MiB) for _ in range(mib))
    (path / "config.json").write_text(json.dumps({"architectures": ["Bench"], "mib": mib}))
    return path


# Ours ------------------------------------------------------------------------------------


async def run_ours(work: Path, ckpt: Path, n_clients: int, corrupt: str = "",
                   bulk: bool = False, next_ckpt: Path | None = None,
                   hash_algo: str = "") -> dict:
    """One swarm: publish `ckpt` as version 1 and time it until every client verified it;
    then, with `next_ckpt`, publish that as version 2 into the same (now formed) swarm and
    time it too ("t_next"): the steady state of a training run, where every version after
    the first finds the peers connected, the mesh built and bulk connections pooled.
    `hash_algo` "blake3": version 1's manifest names a whole-concatenation hash, as older
    nodes published (for an A/B of the shard-list hash); "": the node's default."""
    procs: list[BroadcastProc] = []
    extra = [] if bulk else ["--bulk-listen", "off"]  # the bulk plane is the default
    # the node's default peer-exchange interval (the test harness's own default is 1 s, to
    # join fast; each exchange is a request per connected peer)
    extra += ["--discovery-interval", str(P2PSection().discovery_interval_s)]
    try:
        trainer = BroadcastProc("trainer", "trainer", work / "trainer", *extra)
        procs.append(trainer)
        await trainer.ready(120)
        relay_args = ["--follow", trainer.peer_id, *[x for a in trainer.addrs for x in ("--bootstrap", a)]]
        if corrupt:
            relay_args += ["--corrupt-shards", corrupt]
        relay = BroadcastProc("relay", "relay", work / "relay", *relay_args, *extra)
        procs.append(relay)
        await relay.ready(120)
        clients = []
        for i in range(n_clients):
            c = BroadcastProc(f"c{i}", "inference", work / f"c{i}", "--follow", trainer.peer_id,
                              *[x for a in relay.addrs for x in ("--bootstrap", a)], *extra)
            procs.append(c)
            clients.append(c)
        ready = [await c.ready(120) for c in clients]
        await asyncio.sleep(3)  # gossip mesh
        t_cmd = time.time()
        trainer.send(f"publish {ckpt} 1 {hash_algo}".rstrip())
        pub = await trainer.event("published", 300)
        done = [await c.event("complete", 600) for c in clients]
        relay_done = await relay.event("complete", 600)
        servers, served = {}, {}
        for p in (trainer, relay):  # CPU of the origin and the relay over the same span
            p.send("stats")
            stats = await p.event("stats", 60)
            servers[p.name] = thread_delta(p.info, stats)
            served[p.name] = stats["server"]
        total = pub["total"]
        names = {trainer.peer_id: "origin", relay.peer_id: "relay"}
        origin_bytes = relay_bytes = peer_bytes = 0
        shard = (total + pub["shards"] - 1) // pub["shards"]
        for d in done:
            for peer, s in d["sources"].items():
                role = names.get(peer, "peer")
                nbytes = s["shards_ok"] * shard
                if role == "origin":
                    origin_bytes += nbytes
                elif role == "relay":
                    relay_bytes += nbytes
                else:
                    peer_bytes += nbytes
        for d in done:
            same = all(same_file(Path(d["path"]) / f.name, f) for f in sorted(ckpt.iterdir()))
            if not same:
                raise RuntimeError(f"client copy {d['path']} differs from the origin")
        t_all = max(d["t"] for d in done) - t_cmd
        following = await next_version(trainer, clients, done, next_ckpt) if next_ckpt else {}
        return {**following,
            "t_all": t_all, "t_hash": pub["t"] - pub["t0"], "total": total,
            "t_relay": relay_done["t"] - t_cmd,
            "rss": [d["peak_rss_mib"] for d in done],
            "rss_ready": [r["peak_rss_mib"] for r in ready],
            "cpu": [d["cpu_s"] - r["cpu_s"] for d, r in zip(done, ready, strict=True)],
            "cpu_threads": [thread_delta(r, d) for d, r in zip(done, ready, strict=True)],
            "cpu_servers": servers,
            "p2p": [{k: v - r.get("p2p", {}).get(k, 0) for k, v in d.get("p2p", {}).items()
                     if k in P2P_COUNTERS} for d, r in zip(done, ready, strict=True)],
            "refetched": sum(d["metrics"].get("bytes_fetched", 0) - total for d in done),
            "corrupt_bytes": sum(d["metrics"].get("bytes_corrupt", 0) for d in done),
            "corrupt": sum(d["metrics"].get("shards_corrupt", 0) for d in done),
            "from": (origin_bytes, relay_bytes, peer_bytes),
            # the trainer's uplink: shard bytes it sent (to the relay and the clients)
            "egress": served["trainer"].get("bytes_sent", 0) / total,
            "seeded": served["trainer"].get("error_seeded", 0),
            "rx": [d.get("rx", {}) for d in done],
            "streams": [d.get("streams", {}) for d in done],
            "ok": len(done),
        }
    finally:
        for p in procs:
            p.stop()


async def next_version(trainer: BroadcastProc, clients: list[BroadcastProc], done: list[dict],
                       ckpt: Path) -> dict:
    """Version 2 into the swarm that just finished version 1 (same clients, same sources)."""
    t_cmd = time.time()
    trainer.send(f"publish {ckpt} 2")
    await trainer.event("published", 300)
    later = [await c.event("complete", 600) for c in clients]
    for d in later:
        if d["version"] != 2:
            raise RuntimeError(f"expected version 2 complete, got {d['version']}")
        if not all(same_file(Path(d["path"]) / f.name, f) for f in sorted(ckpt.iterdir())):
            raise RuntimeError(f"client copy {d['path']} of version 2 differs from the origin")
    return {"t_next": max(d["t"] for d in later) - t_cmd,
            "cpu_next": [b["cpu_s"] - a["cpu_s"] for a, b in zip(done, later, strict=True)],
            "cpu_threads_next": [thread_delta(a, b) for a, b in zip(done, later, strict=True)],
            "from_next": [d["sources"] for d in later]}


P2P_COUNTERS = ("gossip_copies_in", "gossip_duplicates", "published", "delivered",
                "requests_sent", "requests_served")


def thread_delta(ready: dict, done: dict) -> dict[str, float]:
    """CPU seconds per thread kind of one client between its ready and complete events."""
    before = ready.get("cpu_threads", {})
    return {k: round(v - before.get(k, 0.0), 2) for k, v in done.get("cpu_threads", {}).items()}


def thread_split(per_client: list[dict[str, float]]) -> str:
    """Median CPU per thread kind over the clients, e.g. "libp2p 0.9, asyncio 0.3" (the
    ":sys" and ":nvcsw" entries are reported by `kernel_split`)."""
    kinds = sorted({k for c in per_client for k in c if ":" not in k})
    med = {k: sorted(c.get(k, 0.0) for c in per_client)[len(per_client) // 2] for k in kinds}
    return ", ".join(f"{k} {v:.1f}" for k, v in sorted(med.items(), key=lambda kv: -kv[1]))


def kernel_split(ours: dict) -> str:
    """The shard receivers' kernel share and bytes per recv call (median over the clients):
    on this VM a receiver's kernel time is mostly the copy into new page-cache pages, whose
    first touch costs ~2-3 CPU-s per GiB once the guest's warm free memory is used up."""
    per = ours["cpu_threads"]
    rx = sorted(c.get("bulk-rx", 0.0) for c in per)
    if not rx or not rx[-1]:
        return ""
    sys_ = sorted(c.get("bulk-rx:sys", 0.0) for c in per)
    calls = sum(r.get("calls", 0) for r in ours.get("rx", []))
    per_call = sum(r.get("bytes", 0) for r in ours.get("rx", [])) / calls / 1024 if calls else 0
    return (f" Shard receivers: {rx[len(rx) // 2]:.2f} CPU-s per client, of which kernel "
            f"{sys_[len(sys_) // 2]:.2f}; {per_call:.0f} KiB per recv call.")


# shardcast -------------------------------------------------------------------------------


class ScProc:
    def __init__(self, *args: str):
        Path(args[1]).mkdir(parents=True, exist_ok=True)
        self.stderr = Path(args[1]) / "stderr.log"
        with open(self.stderr, "w") as err:
            self.proc = subprocess.Popen([str(SHARDCAST_PY), str(SHARDCAST_PEER), *args],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=err, text=True)

    async def event(self, timeout: float) -> dict:
        line = await asyncio.wait_for(asyncio.to_thread(self.proc.stdout.readline), timeout)
        if not line:
            raise RuntimeError(f"shardcast peer {self.proc.args[2:4]} exited: "
                               f"{self.stderr.read_text()[-1500:]}")
        return json.loads(line)

    def send(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


SHARDCAST_DEADLINE_S = 300
"""A shardcast client still without a result this long after the publish is stuck (its
downloads retry without a limit, e.g. 2 of 8 clients in the 15:51 UTC run): stopped and
counted as failed, so one run cannot hold the benchmark lock for 15 minutes."""


async def client_result(client: ScProc, t_cmd: float) -> dict:
    left = max(1.0, t_cmd + SHARDCAST_DEADLINE_S - time.time())
    try:
        return await client.event(left)
    except TimeoutError:
        client.stop()
        return {"event": "stuck"}


def middle_holds_all(middle_dir: Path, total: int) -> bool:
    v1 = middle_dir / "v1"
    if not v1.is_dir():
        return False
    shards = list(v1.glob("shard_*.bin"))
    return bool(shards) and sum(p.stat().st_size for p in shards) == total


async def run_shardcast(work: Path, blob: Path, n_clients: int, corrupt: bool = False) -> dict:
    procs: list[ScProc] = []
    total = blob.stat().st_size
    try:
        origin = ScProc("origin", str(work / "origin"), str(blob))
        procs.append(origin)
        o_url = (await origin.event(120))["url"]
        middle = ScProc("middle", str(work / "middle"), o_url)
        procs.append(middle)
        m_url = (await middle.event(120))["url"]
        clients = []

        async def start_clients():
            # one at a time: shardcast clients probe the server through one shared
            # /tmp/dummy.bin and race on it when started together
            ready = []
            for i in range(n_clients):
                c = ScProc("client", str(work / f"c{i}"), m_url)
                procs.append(c)
                clients.append(c)
                ready.append(await c.event(120))
            return ready

        if not corrupt:
            ready = await start_clients()
        t_cmd = time.time()
        origin.send("go")
        await origin.event(300)
        if corrupt:
            while not middle_holds_all(work / "middle", total):
                await asyncio.sleep(0.2)
            shards = sorted((work / "middle" / "v1").glob("shard_*.bin"))
            victim = shards[min(1, len(shards) - 1)]
            with open(victim, "r+b") as f:  # noqa: ASYNC230 - a local file, once
                f.seek(1000)
                b = f.read(1)
                f.seek(1000)
                f.write(bytes([b[0] ^ 1]))
            ready = await start_clients()
        done = [await client_result(c, t_cmd) for c in clients]
        ok = [d for d in done if d["event"] == "complete"]
        seen = [d["t_seen"] for d in done if "t_seen" in d]
        t_sc = {"t_seen_max": max(seen) - t_cmd if seen else None,
                "stuck": sum(d["event"] == "stuck" for d in done)}
        for d in ok:
            if not same_file(Path(d["path"]), blob):
                raise RuntimeError("shardcast client copy differs")
        return {
            "t_all": (max(d["t"] for d in ok) - t_cmd) if len(ok) == len(done) else None,
            "total": total, "ok": len(ok),
            "rss": [d["peak_rss_mib"] for d in done if "peak_rss_mib" in d],
            "rss_child": [d["peak_child_rss_mib"] for d in done if "peak_child_rss_mib" in d],
            "rss_ready": [r["rss_mib"] for r in ready],
            # a failed whole-file checksum discards every shard (and shardcast does not retry)
            "refetched": (len(done) - len(ok)) * total, **t_sc,
        }
    finally:
        for p in procs:
            p.stop()


# Report ----------------------------------------------------------------------------------


def fmt_rss(values: list[float]) -> str:
    return f"{max(values):.0f}" if values else "-"


HEADERS = ["system", "publish -> all clients verified (s)", "aggregate MiB/s",
           "peak RSS per client (MiB)", "client RSS at start (MiB)",
           "one corrupted shard at the relay"]
DEFAULT = "ours (default: bulk plane, TLS)"


def median_run(runs: list[dict]) -> dict:
    """The run with the median publish -> all verified time (failed runs sort last); its
    other figures (RSS, sources, CPU) go in the table and notes."""
    ranked = sorted(runs, key=lambda r: r["t_all"] if r.get("t_all") else float("inf"))
    return {**ranked[(len(ranked) - 1) // 2], "runs": [r.get("t_all") for r in runs]}


def times(values: list) -> str:
    return ", ".join(f"{v:.2f}" if v else "failed" for v in values)


def label_of(bulk: bool) -> str:
    return DEFAULT if bulk else "ours (libp2p streams only)"


async def run_ours_once(tmp, ckpt, n, bulk, i, next_ckpt=None) -> dict:
    label = label_of(bulk)
    ours = await run_ours(tmp / f"ours-{n}-{bulk}-{i}", ckpt, n, bulk=bulk, next_ckpt=next_ckpt)
    print(label, n, json.dumps(ours), flush=True)
    return ours


async def bench_ours(tmp, ckpt, n, bulk, corrupt_run, rows, notes, results,
                     runs: list[dict] | None = None) -> None:
    """Table row and notes of our system (`runs`: the default's repeated runs, else one run
    here); the corrupted-shard case runs once."""
    label = label_of(bulk)
    runs = runs or [await run_ours_once(tmp, ckpt, n, bulk, 0)]
    ours = results[label] = median_run(runs)
    corrupt_cell = "not run (slow; see the bulk-plane row)"
    if corrupt_run:
        bad = await run_ours(tmp / f"ours-bad-{n}-{bulk}", ckpt, n, corrupt="first", bulk=bulk)
        print(label, "corrupt", n, json.dumps(bad), flush=True)
        corrupt_cell = (f"{bad['corrupt_bytes'] / MiB:.1f} MiB of bad shards re-fetched "
                        f"({bad['corrupt']} bad shards caught; {bad['refetched'] / MiB:.1f} MiB "
                        f"fetched beyond one copy in all; {bad['ok']}/{n} clients verified, "
                        f"{bad['t_all']:.1f} s)")
    shown = f"{ours['t_all']:.1f}" + (f" (median of {times(ours['runs'])})"
                                       if len(runs) > 1 else "")
    rows.append([f"{label}, {n} clients", shown,
                 f"{n * ours['total'] / MiB / ours['t_all']:.1f}",
                 fmt_rss(ours["rss"]), fmt_rss(ours["rss_ready"]), corrupt_cell])
    o, r, p = (x / MiB for x in ours["from"])
    egress = statistics.median([x["egress"] for x in runs if "egress" in x] or [float("nan")])
    notes.append(f"- {label}, {n} clients: trainer egress {egress:.2f}x the checkpoint (median; "
                 f"its shard uploads, to the relay and the clients; goal <= 2x); clients' "
                 f"bytes came from origin {o:.0f} MiB, relay "
                 f"{r:.0f} MiB, other clients {p:.0f} MiB; {ours['refetched'] / MiB:.1f} MiB "
                 f"fetched beyond one copy (timed-out transfers); hashing took "
                 f"{ours['t_hash']:.1f} s of the total; relay complete after "
                 f"{ours['t_relay']:.1f} s; CPU per client from ready to complete "
                 f"{min(ours['cpu']):.1f}-{max(ours['cpu']):.1f} s (median by thread: "
                 f"{thread_split(ours['cpu_threads'])}).{kernel_split(ours)}")
    nexts = [r["t_next"] for r in runs if r.get("t_next")]
    if nexts:
        results[label + " next"] = {"t_all": statistics.median_low(nexts)}
        notes.append(f"- {label}, {n} clients, the next version (version 2 of the same size "
                     f"published into the swarm that just took version 1): "
                     f"{times(nexts)} s; CPU per client "
                     f"{min(c for r in runs for c in r['cpu_next']):.1f}-"
                     f"{max(c for r in runs for c in r['cpu_next']):.1f} s (median run by "
                     f"thread: {thread_split(ours['cpu_threads_next'])}).")


async def run_shardcast_once(tmp, blob, n, i) -> dict:
    sc = await run_shardcast(tmp / f"sc-{n}-{i}", blob, n)
    print("shardcast", n, json.dumps(sc), flush=True)
    return sc


async def bench_shardcast(tmp, blob, n, rows, notes, results,
                          runs: list[dict] | None = None) -> None:
    runs = runs or [await run_shardcast_once(tmp, blob, n, 0)]
    sc = median_run(runs)
    scbad = await run_shardcast(tmp / f"sc-bad-{n}", blob, n, corrupt=True)
    print("shardcast corrupt", n, json.dumps(scbad), flush=True)
    t = sc["t_all"]
    results["shardcast"] = sc
    stuck = f", {sc['stuck']} stuck > {SHARDCAST_DEADLINE_S} s" if sc["stuck"] else ""
    shown = (f"{t:.1f}" if t else f"failed ({sc['ok']}/{n}{stuck})") + (
        f" (median of {times(sc['runs'])})" if len(runs) > 1 else "")
    rows.append([f"shardcast 0.3.2, {n} clients", shown,
                 f"{n * sc['total'] / MiB / t:.1f}" if t else "-",
                 f"{fmt_rss(sc['rss'])} (+ wget {fmt_rss(sc['rss_child'])})",
                 fmt_rss(sc["rss_ready"]),
                 (f"{scbad['refetched'] / MiB:.1f} MiB discarded (whole-file checksum failed), "
                 f"{scbad['ok']}/{n} clients got a copy")])


def page_cache_cost(where: Path, gib: int = 2) -> list[float]:
    """Kernel CPU-s per GiB written into new page-cache pages, GiB by GiB (a plain pwrite
    loop, nothing of ours). On this VM (free page reporting on: freed guest memory goes back
    to the host) the first touch of memory beyond a warm reservoir costs ~10x a warm write;
    every peer's checkpoint copy is such a write, so the benchmark reports the machine's
    state after its runs."""
    buf = memoryview(os.urandom(MiB))
    path = where / "page-cache-probe"
    out = []
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for g in range(gib):
            t0 = time.thread_time()
            for i in range(1024):
                os.pwrite(fd, buf, (g * 1024 + i) * MiB)
            out.append(round(time.thread_time() - t0, 2))
    finally:
        os.close(fd)
        path.unlink()
    return out


def report(args, rows, notes, results_by_n) -> str:
    ratios = []
    four = results_by_n.get(4, {}).get(DEFAULT, {}).get("t_all")
    four_next = results_by_n.get(4, {}).get(DEFAULT + " next", {}).get("t_all")
    for n, results in results_by_n.items():
        sc = results.get("shardcast", {}).get("t_all")
        for label, r in results.items():
            if label == "shardcast" or not sc or not r.get("t_all"):
                continue
            if label.endswith(" next"):
                ratios.append(f"- {n} clients: the next version over the default path took "
                              f"{r['t_all'] / sc:.2f}x shardcast's time for its one version "
                              f"(shardcast was not run for a second version).")
                continue
            goal = " (goal for the default: <= 0.25x)" if label == DEFAULT else ""
            pairs = ""
            if len(r.get("runs", [])) > 1 and len(results["shardcast"].get("runs", [])) > 1:
                pairs = "; run by run, each beside the shardcast run after it: " + ", ".join(
                    f"{a / b:.2f}x" if a and b else "-"
                    for a, b in zip(r["runs"], results["shardcast"]["runs"], strict=False))
            ratios.append(f"- {n} clients: {label} took {r['t_all'] / sc:.2f}x shardcast's "
                          f"time{goal}{pairs}.")
        if n != 4 and four and DEFAULT in results:
            ratios.append(f"- {n} clients, default: {results[DEFAULT]['t_all'] / four:.2f}x our "
                          f"4-client time (goal for 8: <= 2x).")
        if n != 4 and four_next and results.get(DEFAULT + " next"):
            ratios.append(f"- {n} clients, default, the next version: "
                          f"{results[DEFAULT + ' next']['t_all'] / four_next:.2f}x our 4-client "
                          f"next-version time.")
    return (f"Checkpoint: {args.mib} MiB (+ a config.json for ours; shardcast ships the single "
            f"weights file). Loopback, all processes on this machine (the load average below "
            f"includes this benchmark's own processes); --load {args.load} CPU burners ran "
            f"beside both systems.\n\n" + table(HEADERS, rows) + "\n\n"
            + "\n".join(notes + ratios) + f"\n\nLoad average at the end: "
            f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}.")


def headline(args, by_n) -> list[Headline]:
    """The rows of RESULTS.md's headline table a 256 MiB run rewrites."""
    if args.mib != 256:
        return []
    rows = []
    four, eight = by_n.get(4, {}), by_n.get(8, {})
    d4 = four.get(DEFAULT, {}).get("t_all")
    s4 = four.get("shardcast", {}).get("t_all")
    d8 = eight.get(DEFAULT, {}).get("t_all")
    median = " (medians)" if args.repeat > 1 else ""
    if d4 and s4:
        rows.append(Headline("broadcast: 256 MiB to 4 clients vs shardcast", "<= 0.25x",
                             f"{d4:.1f} s = {d4 / s4:.2f}x{median}", f"shardcast {s4:.1f} s"))
    if d4 and d8:
        rows.append(Headline("broadcast: 8 clients vs our 4", "<= 2x",
                             f"{d8:.1f} s = {d8 / d4:.2f}x{median}", f"our 4 clients {d4:.1f} s"))
    return rows


async def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--clients", type=int, nargs="+", default=[4])
    ap.add_argument("--skip-shardcast", action="store_true")
    ap.add_argument("--skip-libp2p", action="store_true")
    ap.add_argument("--libp2p-corrupt", action="store_true",
                    help="also run the corrupted-shard case over libp2p streams (slow)")
    ap.add_argument("--no-record", action="store_true")
    ap.add_argument("--repeat", type=int, default=1,
                    help="runs of the default and of shardcast per client count, alternated; "
                         "the table shows the median")
    ap.add_argument("--skip-next", action="store_true",
                    help="do not publish a second version into each default-path swarm")
    ap.add_argument("--skip-page-cache-probe", action="store_true",
                    help="do not measure the cost of new page-cache pages after the runs")
    ap.add_argument("--load", type=int, default=0,
                    help="run N CPU-burner processes beside both systems for the whole run")
    args = ap.parse_args()
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])  # noqa: ASYNC220
               for _ in range(args.load)]
    try:
        return await run_all(args)
    finally:
        for b in burners:
            b.kill()
            b.wait()


async def run_all(args) -> int:
    with tempfile.TemporaryDirectory(prefix="bench-broadcast-", dir=ROOT / "runs"
                                     if (ROOT / "runs").is_dir() else None) as tmp:
        tmp = Path(tmp)
        ckpt = make_checkpoint(tmp / "ckpt", args.mib)
        blob = ckpt / "model.safetensors"
        ckpt2 = make_checkpoint(tmp / "ckpt2", args.mib) if not args.skip_next else None
        rows, notes, by_n = [], [], {}

        def save():
            body = report(args, rows, notes, by_n)
            print(body, flush=True)
            if not args.no_record:
                record("broadcast", body, headline=headline(args, by_n))

        for n in args.clients:
            results = by_n[n] = {}
            # the default and shardcast alternate, so that both meet the same machine state
            # (on this VM, new page-cache memory costs ~10x once a warm reservoir is used up)
            ours_runs, sc_runs = [], []
            for i in range(args.repeat):
                ours_runs.append(await run_ours_once(tmp, ckpt, n, True, i, next_ckpt=ckpt2))
                if not args.skip_shardcast:
                    sc_runs.append(await run_shardcast_once(tmp, blob, n, i))
            await bench_ours(tmp, ckpt, n, True, True, rows, notes, results, ours_runs)
            save()
            if not args.skip_shardcast:
                await bench_shardcast(tmp, blob, n, rows, notes, results, sc_runs)
                save()
            if not args.skip_libp2p:
                await bench_ours(tmp, ckpt, n, False, args.libp2p_corrupt, rows, notes, results)
                save()
        if not args.skip_page_cache_probe:
            print(f"Page-cache probe after the runs (kernel CPU-s per GiB written into new "
                  f"pages, GiB by GiB; warm memory ~0.2): {page_cache_cost(tmp)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
