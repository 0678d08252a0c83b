"""CPU cost of the bulk plane's encryption: shard bytes through the real plane (TLS 1.3,
node/p2p/bulk: the server's `sendfile` in a worker thread, the client's `receive_into` in
another) against the same bytes over plain TCP (`os.sendfile`, `recv_into`), both ends in
this one process on loopback. Prints CPU seconds (user + system, both ends) per GiB and
MiB/s for each, and the load average; writes nothing.

    .venv/bin/python -m benchmarks.bulk_tls [--mib 512] [--repeat 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import socket
import tempfile
import time
from pathlib import Path

from swarm_node.node.config import BulkSection
from swarm_node.node.identity import Identity
from swarm_node.node.p2p.bulk import BulkClient, BulkServer
from swarm_node.node.p2p.bulk.cert import server_context
from swarm_node.node.p2p.metrics import P2PMetrics

CHUNK = 1 << 20


def cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def over_bulk(path: Path, size: int) -> tuple[float, float]:
    srv, me = Identity.generate(), Identity.generate()
    done = asyncio.Event()

    async def serve(peer, conn):
        await conn.read(1)
        await conn.sendfile(path, 0, size)
        await conn.read(1)
        done.set()

    server = BulkServer(srv.peer_id, server_context(srv), BulkSection(), P2PMetrics())
    server.register("bench", serve)
    _, port = await server.start("127.0.0.1", 0)
    client = BulkClient(me, BulkSection(), query=None)
    client.add_kind("bench", "bench", 1, 5.0)
    client.set_endpoint(srv.peer_id, f"127.0.0.1:{port}")
    conn = await client.open(srv.peer_id, "bench")
    c0, t0 = cpu(), time.perf_counter()
    await conn.write(b"g")
    await conn.receive_into(size, lambda view: None, 30.0, CHUNK)
    t, c = time.perf_counter() - t0, cpu() - c0
    await conn.write(b"x")
    await done.wait()
    conn.abort()
    await server.close()
    return t, c


def over_tcp(path: Path, size: int) -> tuple[float, float]:
    ls = socket.create_server(("127.0.0.1", 0))
    port = ls.getsockname()[1]
    import threading

    def serve():
        s, _ = ls.accept()
        with s, open(path, "rb") as f:
            s.recv(1)
            s.sendfile(f, 0, size)

    th = threading.Thread(target=serve)
    th.start()
    c = socket.create_connection(("127.0.0.1", port))
    buf = memoryview(bytearray(CHUNK))
    c0, t0 = cpu(), time.perf_counter()
    c.sendall(b"g")
    left = size
    while left:
        k = c.recv_into(buf, min(CHUNK, left))
        if not k:
            raise RuntimeError("short")
        left -= k
    t, used = time.perf_counter() - t0, cpu() - c0
    c.close()
    th.join()
    ls.close()
    return t, used


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    size = args.mib * 2**20
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "shard.bin"
        path.write_bytes(os.urandom(size))
        print(f"load before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        for _ in range(args.repeat):
            for name, run in (("tls (bulk plane)", lambda: asyncio.run(over_bulk(path, size))),
                              ("plain tcp", lambda: over_tcp(path, size))):
                t, c = run()
                gib = size / 2**30
                print(f"{name:18s} {size / t / 2**20:7.0f} MiB/s  {c / gib:5.2f} CPU-s/GiB "
                      "(both ends)")
        print(f"load after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
