"""TCP loss recovery in isolation (issue #27, the gossip round's tail): how long a message
on one persistent, mostly idle TCP connection takes beyond the path's one-way delay, with
and without loss, for the per-socket options a sender may set.

    sudo .venv/bin/python benchmarks/tcp_tail.py [--count 300] [--no-record]

A netlab of four public hosts: a -> b over a lossy path (0.5% per leg, ~1% per path, like
wan_plan's), c -> d over the same path without loss; every leg 45.75 ms one way (183 ms RTT,
the 6-node gossip plan's slowest path), 100 Mbit/s up, 200 down. For every variant and both
message sizes (64 KiB: a gossip batch body; 300 B: an announce) one connection per path; each
sends one message a second, the connections staggered within the second so no two bursts
meet. The receiver timestamps each complete message (both ends read one clock: namespaces
share it). Figures: delivery time minus the path's one-way delay (91.5 ms), p50/p95/p99/max.
The delay stage's late_* counters say whether the lab's clock added any of it.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import struct
import sys
import tempfile
import threading
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LEG_MS = 45.75
ONE_WAY_S = 2 * LEG_MS / 1000.0
LEG_LOSS = 0.005
PORT = 7100
SIZES = {"64KiB": 64 * 1024, "300B": 300}
HEADER = struct.Struct("!IId")  # seq, total length, send time (time.time())
TCP_RTO_MIN_US, TCP_DELACK_MAX_US = 45, 46  # Linux >= 6.15
TCP_THIN_LINEAR_TIMEOUTS = 16
# name -> [(level, option, value)], set on both ends of the connection (like a node would)
VARIANTS: dict[str, list[tuple[int, int, int | bytes]]] = {
    "default": [],
    "rto_min 50ms": [(socket.IPPROTO_TCP, TCP_RTO_MIN_US, 50_000)],
    "rto_min 20ms": [(socket.IPPROTO_TCP, TCP_RTO_MIN_US, 20_000)],
    "delack_max 5ms": [(socket.IPPROTO_TCP, TCP_DELACK_MAX_US, 5_000)],
    "rto_min 20ms + delack 5ms": [(socket.IPPROTO_TCP, TCP_RTO_MIN_US, 20_000),
                                  (socket.IPPROTO_TCP, TCP_DELACK_MAX_US, 5_000)],
    "thin linear timeouts": [(socket.IPPROTO_TCP, TCP_THIN_LINEAR_TIMEOUTS, 1)],
    "cubic": [(socket.IPPROTO_TCP, socket.TCP_CONGESTION, b"cubic")],
    "cubic + rto_min 20ms": [(socket.IPPROTO_TCP, socket.TCP_CONGESTION, b"cubic"),
                             (socket.IPPROTO_TCP, TCP_RTO_MIN_US, 20_000)],
}


def _apply(sock: socket.socket, variant: str) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for level, opt, value in VARIANTS[variant]:
        sock.setsockopt(level, opt, value)


def _tcp_info(sock: socket.socket) -> dict:
    raw = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104)
    rto, = struct.unpack_from("I", raw, 8)
    rtt, rttvar = struct.unpack_from("II", raw, 68)
    total_retrans, = struct.unpack_from("I", raw, 100)
    cc = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16).rstrip(b"\0")
    return {"rto_ms": rto / 1000, "srtt_ms": rtt / 1000, "rttvar_ms": rttvar / 1000,
            "retrans": total_retrans, "cc": cc.decode()}


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def role_recv(out: str) -> None:
    """Accept connections; each opens with a JSON hello line (variant, mode), then frames."""
    lock = threading.Lock()
    sink = open(out, "a", buffering=1)  # noqa: SIM115 (open until the process is stopped)
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("0.0.0.0", PORT))
    srv.listen(128)

    def serve(conn: socket.socket) -> None:
        line = b""
        while not line.endswith(b"\n"):
            line += conn.recv(1)
        hello = json.loads(line)
        _apply(conn, hello["variant"])
        while True:
            head = _recv_exact(conn, HEADER.size)
            if head is None:
                return
            seq, total, sent = HEADER.unpack(head)
            if _recv_exact(conn, total - HEADER.size) is None:
                return
            now = time.time()
            with lock:
                sink.write(json.dumps({**hello, "seq": seq, "extra_s": now - sent - ONE_WAY_S})
                           + "\n")

    while True:
        conn, _ = srv.accept()
        threading.Thread(target=serve, args=(conn,), daemon=True).start()


def role_send(dst: str, count: int, out: str) -> None:
    pairs = [(v, m) for v in VARIANTS for m in SIZES]
    start = time.time() + 3.0
    infos: dict[str, dict] = {}

    def run(i: int, variant: str, mode: str) -> None:
        sock = socket.socket()
        _apply(sock, variant)
        deadline = time.monotonic() + 20
        while True:
            try:
                sock.connect((dst, PORT))
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                sock.close()
                time.sleep(0.2)
                sock = socket.socket()
                _apply(sock, variant)
        sock.sendall(json.dumps({"variant": variant, "mode": mode}).encode() + b"\n")
        pad = b"\0" * (SIZES[mode] - HEADER.size)
        for seq in range(count):
            due = start + seq + i / len(pairs)
            time.sleep(max(0.0, due - time.time()))
            sock.sendall(HEADER.pack(seq, SIZES[mode], time.time()) + pad)
        time.sleep(3.0)  # the last message's recovery, then read the counters
        infos[f"{variant}|{mode}"] = _tcp_info(sock)
        sock.close()

    threads = [threading.Thread(target=run, args=(i, v, m)) for i, (v, m) in enumerate(pairs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    Path(out).write_text(json.dumps(infos))


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--role", choices=("recv", "send"))
    ap.add_argument("--dst")
    ap.add_argument("--out")
    ap.add_argument("--count", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--variants", nargs="+", choices=list(VARIANTS), help="only these")
    ap.add_argument("--slow-start-after-idle", type=int, choices=(0, 1),
                    help="net.ipv4.tcp_slow_start_after_idle in every lab host (default: "
                         "the kernel's, 1)")
    ap.add_argument("--no-record", action="store_true")
    ap.add_argument("--json", help="write the summary here too")
    args = ap.parse_args()
    for name in set(VARIANTS) - set(args.variants or VARIANTS):
        del VARIANTS[name]
    if args.role == "recv":
        return role_recv(args.out)
    if args.role == "send":
        return role_send(args.dst, args.count, args.out)

    from swarm_node.node.testing.netlab import Host, Lab, Link, Topology
    from swarm_node.node.testing.netlab.lab import wait_for

    from benchmarks.results import record, table

    def link(loss: float) -> Link:
        return Link(latency_ms=LEG_MS, loss=loss, up_mbit=100, down_mbit=200)

    topo = Topology(hosts=(Host("a", link(LEG_LOSS)), Host("b", link(LEG_LOSS)),
                           Host("c", link(0.0)), Host("d", link(0.0))))
    load = os.getloadavg()[0]
    tmp = Path(tempfile.mkdtemp(prefix="tcp_tail"))
    me = [sys.executable, str(Path(__file__).resolve())]
    with Lab(topo, prefix="tcptail", seed=args.seed) as lab:
        if args.slow_start_after_idle is not None:
            for h in "abcd":
                ssai = f"net.ipv4.tcp_slow_start_after_idle={args.slow_start_after_idle}"
                lab.run(h, ["sysctl", "-qw", ssai], check=True)
        for rx in ("b", "d"):
            lab.popen(rx, [*me, "--role", "recv", "--out", str(tmp / f"{rx}.jsonl")])
        only = ["--variants", *VARIANTS]
        senders = [lab.popen(tx, [*me, "--role", "send", "--dst", lab.addr(rx), "--count",
                                  str(args.count), "--out", str(tmp / f"{tx}.json"), *only])
                   for tx, rx in (("a", "b"), ("c", "d"))]
        wait_for(lambda: all(p.poll() is not None for p in senders), args.count + 60,
                 "the senders", poll=1.0)
        stage = lab.stage_stats()
        if any(p.returncode for p in senders):
            raise SystemExit(f"a sender failed: {[p.returncode for p in senders]}")
    load = max(load, os.getloadavg()[0])
    infos = {"lossy": json.loads((tmp / "a.json").read_text()),
             "no loss": json.loads((tmp / "c.json").read_text())}
    got: dict[tuple[str, str, str], list[float]] = {}
    for path, rx in (("lossy", "b"), ("no loss", "d")):
        for line in (tmp / f"{rx}.jsonl").read_text().splitlines():
            r = json.loads(line)
            got.setdefault((path, r["variant"], r["mode"]), []).append(r["extra_s"])
    rows, summary = [], {"stage": stage, "load": load, "count": args.count, "rows": [],
                         "slow_start_after_idle": args.slow_start_after_idle}
    for path in ("lossy", "no loss"):
        for mode in SIZES:
            for variant in VARIANTS:
                v = got.get((path, variant, mode), [])
                info = infos[path].get(f"{variant}|{mode}", {})
                if not v:
                    rows.append([path, mode, variant, "0", "-", "-", "-", "-", "-", "-"])
                    continue
                ms = [1000 * x for x in v]
                row = {"path": path, "mode": mode, "variant": variant, "n": len(ms),
                       "p50": _pct(ms, .5), "p95": _pct(ms, .95), "p99": _pct(ms, .99),
                       "max": max(ms), "retrans": info.get("retrans"),
                       "rto_ms": info.get("rto_ms"), "cc": info.get("cc")}
                summary["rows"].append(row)
                rows.append([path, mode, variant, str(len(ms)), f"{row['p50']:.0f}",
                             f"{row['p95']:.0f}", f"{row['p99']:.0f}", f"{row['max']:.0f}",
                             str(row["retrans"]), f"{row['rto_ms']:.0f} ({row['cc']})"])
    text = table(["path", "message", "variant", "n", "p50 ms", "p95 ms", "p99 ms", "max ms",
                  "retrans", "final RTO ms (cc)"], rows)
    late = (f"delay stage: {stage.get('packets')} packets, lost {stage.get('lost')}, "
            f"late_2ms {stage.get('late_2ms')}, late_10ms {stage.get('late_10ms')}, "
            f"late max {1000 * stage.get('late_s_max', 0):.1f} ms, tun_drops "
            f"{stage.get('tun_drops')}")
    print(text)
    print(late)
    print(f"load {load:.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    if not args.no_record:  # compact: RESULTS.md is kept under 100 kB
        by = {(r["path"], r["mode"], r["variant"]): r for r in summary["rows"]}
        brief = [[m, v, f"{by[('no loss', m, v)]['p50']:.0f}",
                  "/".join(f"{by[('lossy', m, v)][k]:.0f}" for k in ("p50", "p95", "p99", "max"))]
                 for m in SIZES for v in VARIANTS
                 if ("no loss", m, v) in by and ("lossy", m, v) in by]
        ssai = ("" if args.slow_start_after_idle is None
                else f"; tcp_slow_start_after_idle={args.slow_start_after_idle}")
        record("tcp-tail", table(["msg", "variant", "no loss p50", "lossy p50/p95/p99/max"],
                                 brief) + f"\n\nms beyond one-way delay, n={args.count}{ssai}; "
               + late + "\n", headline=())


if __name__ == "__main__":
    main()
