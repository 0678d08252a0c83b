"""A connection flood against a bulk plane (issue 30, handshake slots), as its own process:
`python -m swarm_node.node.testing.bulk_flood --target HOST:PORT --server-peer ID ...`.

Modes: `silent` opens TCP connections and sends nothing; `hello` opens TLS connections and
authenticates them with `--identities` fresh keys in turn, then holds them without a
request. Either way every connection the server closes is opened again (kept topped up),
at most `--rate` new connections per second (a spinning attacker would only measure this
machine's two cores). Prints one JSON line {"event": "ready", ...} once each of the `--conns`
slots has its first outcome (silent: the connection opened or failed; hello: the server's
status, or the connection failed or was closed before it), and {"event": "stats", ...} for
each "stats" line on stdin; exits at end of input.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections import Counter

from ..identity import Identity
from ..p2p.bulk.cert import client_context
from ..p2p.bulk.hello import ACCEPTED, CHALLENGE_LEN, STATUS, hello_frame


class Flood:
    def __init__(self, args):
        self.args = args
        host, _, port = args.target.rpartition(":")
        self.host, self.port = host, int(port)
        self.ids = [Identity.generate() for _ in range(max(1, args.identities))]
        self.ctx = client_context()
        self.counts: Counter[str] = Counter()
        self.open = 0
        self.next_id = 0
        self._slots = asyncio.Semaphore(1)
        self._last = 0.0
        self.settled = 0  # slots whose first connection has its outcome
        self.all_settled = asyncio.Event()

    def _settle(self) -> None:
        self.settled += 1
        if self.settled >= self.args.conns:
            self.all_settled.set()

    async def _paced(self) -> None:
        async with self._slots:  # one new connection per 1/rate seconds
            wait = self._last + 1 / self.args.rate - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            self._last = time.monotonic()

    async def one(self) -> None:
        """One connection slot, kept topped up forever."""
        first = True

        def outcome() -> None:
            nonlocal first
            if first:
                first = False
                self._settle()

        while True:
            await self._paced()
            try:
                await self._connection(outcome)
            except (OSError, asyncio.IncompleteReadError, ConnectionError) as e:
                self.counts[f"error_{type(e).__name__}"] += 1
            outcome()  # failed or closed before its outcome: that is its outcome

    async def _connection(self, outcome) -> None:
        ssl = self.ctx if self.args.mode == "hello" else None
        reader, writer = await asyncio.open_connection(
            self.host, self.port, ssl=ssl, server_hostname="" if ssl else None,
            local_addr=(self.args.source_ip, 0))
        self.counts["opened"] += 1
        self.open += 1
        try:
            if self.args.mode == "hello":
                ident = self.ids[self.next_id % len(self.ids)]
                self.next_id += 1
                challenge = await reader.readexactly(CHALLENGE_LEN)
                writer.write(hello_frame(ident, self.args.server_peer, self.args.kind,
                                         challenge))
                status = await reader.readexactly(1)
                self.counts[STATUS.get(status, "unknown")] += 1
                outcome()
                if status != ACCEPTED:
                    return
            else:
                outcome()
            while await reader.read(1 << 16):  # hold it, silent, until the server closes
                pass
            self.counts["closed_by_server"] += 1
        finally:
            self.open -= 1
            writer.transport.abort()

    def stats(self, event: str) -> None:
        print(json.dumps({"event": event, "open": self.open, "settled": self.settled,
                          **self.counts}), flush=True)


async def main_async(args) -> None:
    flood = Flood(args)
    tasks = [asyncio.create_task(flood.one()) for _ in range(args.conns)]
    try:
        await asyncio.wait_for(flood.all_settled.wait(), 60)
    except TimeoutError:
        pass  # said by the counts
    flood.stats("ready")
    try:
        while True:
            line = await asyncio.to_thread(sys.stdin.readline)
            if not line:
                break
            flood.stats("stats")
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bulk_flood")
    ap.add_argument("--target", required=True, help="the bulk plane, host:port")
    ap.add_argument("--server-peer", default="", help="its peer id (hello mode)")
    ap.add_argument("--mode", choices=["silent", "hello"], default="silent")
    ap.add_argument("--conns", type=int, default=64)
    ap.add_argument("--identities", type=int, default=1)
    ap.add_argument("--kind", default="body")
    ap.add_argument("--source-ip", default="127.0.0.1")
    ap.add_argument("--rate", type=float, default=200.0, help="new connections per second")
    asyncio.run(main_async(ap.parse_args(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
