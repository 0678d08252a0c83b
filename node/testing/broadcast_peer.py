"""A broadcast-only peer in its own process (no sampler, no trainer): a trainer origin that
publishes checkpoint directories, a relay, or a follower. A harness for the multi-process
fault tests and benchmarks/broadcast.py, not a role (the relay role is node/roles/relay.py).

    python -m swarm_node.node.testing.broadcast_peer --role relay --data-dir D \
        --bootstrap /ip4/127.0.0.1/tcp/4001/p2p/<id> --follow <trainer peer id>

Prints one JSON object per line on stdout: {"event": "ready", "peer_id", "addrs"}, then
"published", "complete" (with metrics), "rejected" (with a reason), and with
`--shard-events` one "shard" (with its source) per verified shard, once it is on disk and
in the bitmap a restart resumes from. Reads commands on
stdin, one per line: `publish DIR VERSION [HASH_ALGO]`, `offer FILE` (a sealed manifest
envelope), `rate MIB_S` (cap uploads), `stats`, `quit`. `--corrupt-shards 3,7` (or
`first`) is fault injection (this peer serves those shards with one flipped byte), for
tests and benchmarks.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import threading
import time
from pathlib import Path

from ..broadcast.errors import ManifestRejected
from ..broadcast.follow import TrainerChoice, bootstrap_peer_ids
from ..broadcast.server import RateLimiter
from ..broadcast.service import Broadcaster, Completed
from ..config import load_config
from ..diskspace import configure as configure_disk
from ..identity import Identity
from ..p2p import P2PNode
from .procstats import cpu_seconds, peak_rss_mib


def emit(**obj) -> None:
    print(json.dumps(obj), flush=True)


def thread_cpu() -> dict[str, float]:
    """CPU seconds per thread kind of this process (libp2p's trio thread, the asyncio loop,
    bulk-plane receivers and senders (TLS), other workers): where a peer's CPU goes, for
    the benchmark notes."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended meanwhile
            continue
        name = names.get(int(task.name), "other")
        kind = ("libp2p" if name.startswith("p2p") else "asyncio" if name == "MainThread"
                else name[:7] if name.startswith(("bulk-rx", "bulk-tx")) else "workers")
        out[kind] = out.get(kind, 0.0) + (int(fields[11]) + int(fields[12])) / tick
        out[kind + ":sys"] = out.get(kind + ":sys", 0.0) + int(fields[12]) / tick
        out[kind + ":nvcsw"] = out.get(kind + ":nvcsw", 0.0) + _switches(task)
    return {k: round(v, 2) for k, v in out.items()}


def _switches(task: Path) -> int:
    """Involuntary context switches of one thread (preempted while runnable)."""
    try:
        for line in (task / "status").read_text().splitlines():
            if line.startswith("nonvoluntary_ctxt_switches:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def corrupting(store, spec: str):
    """Wrap `store.read_shard` so that some shards carry one flipped byte: `spec` is a
    comma-separated list of indices, or `first` (whichever shard this peer serves first)."""
    inner = store.read_shard
    bad = set() if spec == "first" else {int(i) for i in spec.split(",")}

    def read_shard(entry, index, offset=0, length=0, chunk=1 << 20):
        it = inner(entry, index, offset, length, chunk)
        if spec == "first" and not bad:
            bad.add(index)
        if index not in bad:
            return it

        def flipped():
            first = True
            for data in it:
                yield bytes([data[0] ^ 1]) + data[1:] if first else data
                first = False
        return flipped()

    store.read_shard = read_shard


async def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="swarm-node-broadcast")
    ap.add_argument("--role", choices=["trainer", "relay", "inference"], required=True)
    ap.add_argument("--data-dir", type=Path, required=True)
    ap.add_argument("--key", type=Path)
    ap.add_argument("--listen", default="/ip4/127.0.0.1/tcp/0")
    ap.add_argument("--bootstrap", action="append", default=[])
    ap.add_argument("--follow", action="append", default=[])
    ap.add_argument("--shard-size", type=int)
    ap.add_argument("--parallel", type=int)
    ap.add_argument("--chunk-timeout", type=float)
    ap.add_argument("--readvertise", type=float)
    ap.add_argument("--advert-interval", type=float)
    ap.add_argument("--discovery-interval", type=float, default=1.0,
                    help="p2p.discovery_interval_s (tests: 1 s to join fast; node default 5 s)")
    ap.add_argument("--bulk-listen", default="auto",
                    help='bulk plane (bulk.listen): "auto" (default), "host:port" or "off"')
    ap.add_argument("--bulk-advertise", default="", help="bulk.advertise: endpoint in adverts")
    ap.add_argument("--bulk-handshake-timeout", type=float, default=5.0)
    ap.add_argument("--corrupt-shards", default="")
    ap.add_argument("--shard-events", action="store_true",
                    help='print a "shard" event per verified shard (tests wait on them)')
    ap.add_argument("--min-free-mib", type=int, default=256,
                    help="free disk space every large write leaves (node.min_free_disk_mib)")
    ap.add_argument("--log-level", default="WARNING")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override (broadcast.max_uploads_total=8), for benchmarks")
    args = ap.parse_args(argv)
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")

    overrides = {"node.listen": [args.listen], "node.role": args.role,
                 "p2p.discovery_interval_s": args.discovery_interval,
                 "p2p.bootstrap_timeout_s": 20, "p2p.mesh_wait_s": 3,
                 "broadcast.shard_size": args.shard_size or None,
                 "broadcast.parallel_downloads": args.parallel or None,
                 "bulk.listen": args.bulk_listen, "bulk.advertise": args.bulk_advertise,
                 "bulk.handshake_timeout_s": args.bulk_handshake_timeout,
                 "broadcast.advert_interval_s": args.advert_interval or None,
                 "broadcast.readvertise_s": args.readvertise or None,
                 "broadcast.chunk_timeout_s": args.chunk_timeout or None,
                 **dict(kv.split("=", 1) for kv in args.set)}
    cfg = load_config(None, overrides)  # None values: the default
    ident = Identity.load_or_create(args.key) if args.key else Identity.generate()
    node = P2PNode(ident, cfg)
    t_start = time.time()

    def on_complete(done: Completed) -> None:
        m = done.manifest
        emit(event="complete", policy=m.policy_id, version=m.version, path=str(done.path),
             t=time.time(), metrics=done.metrics, times=done.times, sources=done.sources,
             flights=done.flights,
             streams=dict(bc.transport.opened), rx=node.bulk.client.rx.as_dict(),
             peak_rss_mib=peak_rss_mib(), cpu_s=cpu_seconds(), cpu_threads=thread_cpu(),
             p2p=dict(node.metrics.counters))

    configure_disk(args.min_free_mib * 2**20)
    choice = None if args.role == "trainer" else TrainerChoice(
        args.data_dir, args.follow, bootstrap_peer_ids(args.bootstrap))
    bc = Broadcaster(node, cfg.broadcast, args.data_dir / "broadcast", follow=args.follow,
                     role=args.role, on_complete=on_complete, interactive=False, choice=choice)
    if args.shard_events:
        proven = bc.proven.add  # called by a download once a shard verified and is saved

        def verified(peer: str) -> None:
            proven(peer)
            emit(event="shard", source=peer, t=time.time())
        bc.proven.add = verified
    bc.server.enable_trace()  # the benchmarks' per-shard accounts (`stats` says it)
    if args.corrupt_shards:
        corrupting(bc.store, args.corrupt_shards)
        bc.server.zero_copy = False  # sendfile would bypass the corrupting reader
    await node.start(bootstrap=args.bootstrap)
    await bc.start()
    emit(event="ready", peer_id=node.peer_id, addrs=node.listen_addrs, t=time.time(),
         bulk=list(node.bulk.bound) if node.bulk.bound else None,
         startup_s=time.time() - t_start, peak_rss_mib=peak_rss_mib(), cpu_s=cpu_seconds(),
         cpu_threads=thread_cpu(), p2p=dict(node.metrics.counters))
    try:
        while True:
            line = await asyncio.to_thread(sys.stdin.readline)
            if not line or line.strip() == "quit":
                break
            cmd, *rest = line.split()
            if cmd == "publish":
                t0 = time.time()
                m = await bc.publish(Path(rest[0]), int(rest[1]),
                                     hash_algo=rest[2] if len(rest) > 2 else None)
                emit(event="published", version=m.version, total=m.total_size,
                     shards=m.num_shards, t0=t0, t=time.time())
            elif cmd == "offer":
                try:
                    acc = bc.accept_bytes(Path(rest[0]).read_bytes())
                    emit(event="accepted", version=acc.manifest.version)
                except ManifestRejected as e:
                    emit(event="rejected", reason=e.reason, detail=str(e))
            elif cmd == "rate":  # cap this peer's upload rate (MiB/s), e.g. to slow a source
                bc.server.limiter = RateLimiter(float(rest[0]) * 2**20)
                emit(event="rate", mib_s=float(rest[0]))
            elif cmd == "stats":
                emit(event="stats", server=dict(bc.server.metrics),
                     bulk={k: v for k, v in node.metrics.counters.items()
                           if k.startswith("bulk_")},
                     endpoint=bc.endpoint, reachability=node.reachability.verdict.value,
                     rejected=dict(bc.gate.rejected), peak_rss_mib=peak_rss_mib(),
                     downloads={p: dict(j.downloader.metrics)
                                for p, j in bc.follower.jobs.items() if j.downloader},
                     disk=bc.disk.status(), follow=sorted(bc.gate.follow),
                     held=[list(k) for k, e in bc.store.entries.items() if e.complete],
                     counters=bc.counters(), cpu_s=cpu_seconds(),
                     cpu_threads=thread_cpu(), p2p=dict(node.metrics.counters),
                     peers=node.connected_peers(), trace=list(bc.server.trace or ()))
    finally:
        await bc.close()
        await node.close()
    emit(event="exit", peak_rss_mib=peak_rss_mib())
    return 0


if __name__ == "__main__":
    code = asyncio.run(main())
    # Closed, "exit" said and flushed: skip the interpreter's teardown (freeing py-libp2p's
    # ~1,450 modules took 1.6 s of CPU, ten times the close; tests wait for this exit).
    sys.stdout.flush()
    os._exit(code)
