"""Serves verified shards over the shard protocol (wire.py), with limits.

Every request gets an answer or a closed stream, never a hang: a malformed request gets
`bad_request`, a shard not held (or not yet verified) `unknown_shard`, a range outside the
shard `bad_range`, a request over the concurrency limits `busy` at once, and (a trainer, for
its own checkpoints: seeding.py) a shard already handed to the swarm `seeded`, on a stream
that stays open for the next request.

Spreading (`max_uploads_per_shard`, 2): a node uploads at most that many copies of one
shard of a version it did not publish at once, and answers `seeded` to the next askers
(they take the shard from the peers it is going to, or ask again after their hold-back:
downloader.py). Measured first (the simulated WAN, 12 nodes): a public follower that took
the trainer's first copies of 3 shards uploaded each to all 10 other receivers at once,
~30 flows on its 100 Mbit/s uplink at 0.2 MiB/s each; every receiver's copy of those
shards ended 15-25 s after it began, together, and nobody else held them before. An upload the
client does not take (each `chunk_size` bytes within `chunk_timeout_s`) is cut, so a peer
that asks and never reads cannot hold upload slots that honest peers need. The upload
limiter's pace counts in that window too (the client abandons a transfer that delivers no
bytes for `chunk_timeout_s` whatever the cause): before (heal48), an upload asleep in the
limiter held its slot for as long as the limiter's debt said, its client long gone. Measured
in test_supersede.py: a follower's 4 uploads from a trainer throttled to 100 B/s slept
327-1310 s each (4 slots, `max_uploads_per_peer`), and its next version, served again at the
old pace, got only `busy` answers (292) and no byte in 15 s.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, deque

from ...protocol.errors import ProtocolError
from ...protocol.messages import ShardRequest, ShardResponseHeader
from .errors import BroadcastError
from .seeding import Seeding
from .store import ShardStore
from .wire import CLOSE_TIMEOUT_S, ByteStream, read_frame, write_frame

log = logging.getLogger(__name__)


class RateLimiter:
    """Token bucket over bytes; rate 0 means unlimited."""

    def __init__(self, rate_bytes_s: float, burst_s: float = 0.25):
        self.rate = rate_bytes_s
        self.capacity = rate_bytes_s * burst_s
        self.tokens = self.capacity
        self.last = time.monotonic()

    async def acquire(self, n: int) -> None:
        if self.rate <= 0:
            return
        now = time.monotonic()
        self.tokens = min(self.capacity, self.tokens + (now - self.last) * self.rate)
        self.last = now
        self.tokens -= n
        if self.tokens < 0:
            try:
                await asyncio.sleep(-self.tokens / self.rate)
            except asyncio.CancelledError:
                self.tokens += n  # never sent (an upload cut): later ones do not wait for it
                raise


async def _abort(stream: ByteStream) -> None:
    """End a stalled upload now: a TCP connection is aborted (unsent bytes dropped, the
    socket freed at once; a plain close would wait for a reader that never reads), a
    libp2p stream is reset."""
    writer = getattr(stream, "writer", None)
    if writer is not None:
        writer.transport.abort()
    elif hasattr(stream, "reset"):
        await stream.reset()


MAX_SERVED_PEERS = 4096  # peers counted one by one in `served_to`
MAX_TRACE = 8192
"""Served shards remembered in `ShardServer.trace` (the newest), for benchmarks' per-shard
accounts of who carried which copy and when."""


class ShardServer:
    def __init__(self, store: ShardStore, cfg):
        self.store = store
        self.cfg = cfg
        self.active: Counter[str] = Counter()
        self.active_total = 0
        self.active_shards: Counter[tuple[str, int, int]] = Counter()  # (policy, version, shard)
        self.limiter = RateLimiter(cfg.upload_rate_mib_s * 2**20)
        self.metrics: Counter[str] = Counter()
        self.served_to: Counter[str] = Counter()  # bytes of whole answers, per peer (bounded)
        self.zero_copy = True  # TCP uploads with sendfile(2) when not paced
        self.seeding: Seeding | None = None  # a trainer's rule for its own versions
        # (start, end (wall time), version, shard, peer, outcome): each whole answer
        # ("sent"), `seeded` answer and upload that did not complete ("cut"); bounded, and
        # only once `enable_trace` was called (benchmarks: ~1.5 MiB at MAX_TRACE)
        self.trace: deque[tuple[float, float, int, int, str, str]] | None = None

    def enable_trace(self) -> None:
        """Keep the newest MAX_TRACE served shards in `trace` (benchmark harnesses)."""
        self.trace = deque(maxlen=MAX_TRACE)

    def _traced(self, *row) -> None:
        if self.trace is not None:
            self.trace.append(row)

    async def handle(self, peer: str, stream: ByteStream) -> None:
        """One request on one stream, then close it (how a node before stream reuse served;
        the tests' stand-in for one)."""
        await self._serve(peer, stream, keep=False)

    async def serve_connection(self, peer: str, stream: ByteStream) -> None:
        """Requests one after another on one stream or bulk-plane connection, until the
        client closes it, an answer is not a complete shard, or no request comes within
        `request_timeout_s` (profiled: a TCP connection, hello and accept per 4 MiB shard
        were a visible share of every peer's event-loop CPU)."""
        await self._serve(peer, stream, keep=True)

    async def _serve(self, peer: str, stream: ByteStream, keep: bool) -> None:
        try:
            served = await self._handle(peer, stream)
            while keep and served:
                served = await self._handle(peer, stream, idle_ok=True)
        except Exception as e:  # noqa: BLE001 - a broken peer stream must not kill the node
            self.metrics["aborted"] += 1
            log.debug("shard upload to %s aborted: %r", peer, e)
        finally:
            try:
                async with asyncio.timeout(CLOSE_TIMEOUT_S):
                    await stream.close()
            except Exception as e:  # noqa: BLE001 - already broken
                log.debug("closing the stream to %s failed: %r", peer, e)

    def _take_within(self, n: int) -> float:
        """Seconds a client has to take n bytes of an answer: `chunk_timeout_s` per
        `chunk_size` (for a paced upload, the wait on the upload limiter included)."""
        return self.cfg.chunk_timeout_s * max(1.0, n / self.cfg.chunk_size)

    async def _sendfile(self, stream, entry, shard: int, offset: int, length: int) -> bool:
        try:
            pieces = self.store.shard_files(entry, shard, offset, length)
            if any(p.stat().st_size < off + n for p, off, n in pieces):
                raise OSError("shorter than its manifest size")
        except OSError:  # pruned meanwhile
            await self._error(stream, "unknown_shard")
            return False
        async with asyncio.timeout(self.cfg.chunk_timeout_s):
            await write_frame(stream, ShardResponseHeader(ok=True, length=length).encode())
        for path, off, n in pieces:
            async with asyncio.timeout(self._take_within(n)):
                await stream.sendfile(path, off, n)
            self.metrics["bytes_sent"] += n
        self.metrics["shards_sent"] += 1
        self.metrics["shards_sendfile"] += 1
        return True

    async def _error(self, stream: ByteStream, code: str) -> None:
        self.metrics[f"error_{code}"] += 1
        await write_frame(stream, ShardResponseHeader(ok=False, error=code).encode())

    async def _handle(self, peer: str, stream: ByteStream, idle_ok: bool = False) -> bool:
        """Answer one request; True if a whole shard went out (the stream may carry another
        request). `idle_ok`: a reused connection that ends or idles before a request is
        closed quietly, not answered `bad_request`."""
        try:
            async with asyncio.timeout(self.cfg.request_timeout_s):
                raw = await read_frame(stream)
        except (TimeoutError, asyncio.IncompleteReadError) as e:
            if idle_ok and (isinstance(e, TimeoutError) or not e.partial):
                return False
            await self._error(stream, "bad_request")
            return False
        except (ProtocolError, BroadcastError):
            await self._error(stream, "bad_request")
            return False
        except Exception as e:
            # a libp2p stream the client closed after its last request (StreamError "eof")
            if idle_ok and getattr(e, "reason", None) == "eof":
                return False
            raise
        try:
            req = ShardRequest.decode(raw)
        except ProtocolError:
            await self._error(stream, "bad_request")
            return False
        self.metrics["requests"] += 1
        entry = self.store.get(req.policy_id, req.version)
        if entry is None or req.shard >= entry.manifest.num_shards or not entry.has(req.shard):
            await self._error(stream, "unknown_shard")
            return False
        size = entry.shard_len(req.shard)
        length = size - req.offset if req.length == 0 else req.length
        if req.offset > size or length <= 0 or req.offset + length > size \
                or length > self.cfg.max_shard_size:
            await self._error(stream, "bad_range")
            return False
        if self.seeding is not None and not self.seeding.take(entry.key, req.shard, peer):
            return await self._seeded(stream, req, peer)
        copy = self.seeding is not None
        spread = (*entry.key, req.shard)
        if not copy and 0 < self.cfg.max_uploads_per_shard <= self.active_shards[spread]:
            self.metrics["spread_seeded"] += 1  # its copies are on their way: take one there
            return await self._seeded(stream, req, peer)
        if (self.active[peer] >= self.cfg.max_uploads_per_peer
                or self.active_total >= self.cfg.max_uploads_total):
            if copy:
                self.seeding.give_back(entry.key, req.shard)
            await self._error(stream, "busy")
            return False
        self.active[peer] += 1
        self.active_total += 1
        self.active_shards[spread] += 1
        done = False
        t0 = time.time()
        try:
            done = await self._upload(stream, entry, req, length)
            if done:
                if peer not in self.served_to and len(self.served_to) >= MAX_SERVED_PEERS:
                    peer = "(other)"
                self.served_to[peer] += length
            return done
        except TimeoutError:
            self.metrics["upload_stalled"] += 1
            log.info("cut a shard upload to %s: the client did not take it in time", peer)
            await _abort(stream)
            return False
        finally:
            self._traced(t0, time.time(), req.version, req.shard, peer,
                         "sent" if done else "cut")
            if copy and done:
                self.seeding.delivered(entry.key, req.shard)
            elif copy:
                self.seeding.give_back(entry.key, req.shard)
            self.active[peer] -= 1
            if self.active[peer] <= 0:
                del self.active[peer]
            self.active_total -= 1
            self.active_shards[spread] -= 1
            if self.active_shards[spread] <= 0:
                del self.active_shards[spread]

    async def _seeded(self, stream: ByteStream, req: ShardRequest, peer: str) -> bool:
        """Answer `seeded` (the shard is in the swarm: take it from its holders); True: not
        an error of the stream, which may carry the next request."""
        now = time.time()
        self._traced(now, now, req.version, req.shard, peer, "seeded")
        await self._error(stream, "seeded")
        return True

    async def _upload(self, stream: ByteStream, entry, req: ShardRequest, length: int) -> bool:
        """Send one answer; TimeoutError if the client does not take it, or the upload
        limiter does not let it go, within _take_within."""
        if self.zero_copy and self.limiter.rate <= 0 and hasattr(stream, "sendfile"):
            return await self._sendfile(stream, entry, req.shard, req.offset, length)
        chunks = self.store.read_shard(entry, req.shard, req.offset, length,
                                       self.cfg.chunk_size)
        try:
            first = next(chunks)  # open the file before promising the bytes
        except (OSError, BroadcastError, StopIteration):
            await self._error(stream, "unknown_shard")
            return False
        async with asyncio.timeout(self.cfg.chunk_timeout_s):
            await write_frame(stream, ShardResponseHeader(ok=True, length=length).encode())
        data = first
        while data is not None:
            async with asyncio.timeout(self._take_within(len(data))):
                await self.limiter.acquire(len(data))
                await stream.write(data)
            self.metrics["bytes_sent"] += len(data)
            data = next(chunks, None)
        self.metrics["shards_sent"] += 1
        return True
