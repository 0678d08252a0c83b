"""Fetches the missing shards of one version from several sources in parallel.

Each shard is streamed to disk while it is hashed (memory: one chunk per transfer), and
kept only if its BLAKE3 matches the signed manifest. A bad shard is re-fetched from another
source and the sender is penalised (`SourceBook.corrupt`); a failed or stalled transfer is
retried elsewhere. Shards already verified on disk (after a restart) are never fetched
again. When every shard verified, the store assembles the checkpoint (and, for manifests
that name a whole-concatenation hash, checks it).

Endgame: a transfer held by a source on trial (sources.py) is taken back (a failed trial:
the source cools down, and is dropped after `trial_failures`) when a worker has nothing
else to do and the trial has run longer than a known-good source takes for a shard
(`_patience`): advertisers that take a request and never answer cannot hold the last
shards until their timeout.

A source that answers `seeded` (the trainer: that shard is in the swarm already; seeding.py)
is not asked for that shard again for `HOLD_BACK_S`, doubling per answer up to
`HOLD_BACK_MAX_S`; the shard is taken from a peer that holds it meanwhile. Another holder
answers `seeded` while it uploads that shard to `max_uploads_per_shard` others (server.py):
it is asked again after `HOLD_BACK_S` each time, as a place frees when one of those ends
(doubling, a relay in the simulated WAN had nothing in flight for 34 s of its download
while the holders it knew of its last shards were busy a few seconds at a time). Nothing is held
against the source: it stays known-good and serves other shards.

Endgame (like BitTorrent's): once every missing shard is in flight and a worker has
nothing else to do, the transfer expected to end last (by the bytes it received so far) is
raced by a second copy from another source that holds the shard, if that source is expected
to deliver it in well under the time left (`ENDGAME_MIN_S`, `ENDGAME_FASTER`; by its
measured rate shared among the transfers it already carries for us). Never from a source
not measured yet (in the simulated WAN those were the slow home uplinks), nor from the
trainer (its uplink would carry the copy the swarm is meant to). The second copy is
held in memory and hashed (store.SpareShardWriter); the first verified copy is written in
place and the other transfer is cancelled. The loser is not held against its source (it
was slower, not wrong). Extra bytes: at most one shard per transfer in flight at the
endgame, counted (`endgame_*` metrics). Measured first: in the simulated WAN a public
follower holding several first copies served every other follower at once (~0.3 MiB/s
each), and the last shards of each download waited on it.

Workers wait for an event (a transfer ended, sources changed) or for the moment the next
source leaves its cooldown, never in a fixed poll, and a worker looks for its next shard
in time that grows with the transfers in flight, not with the number of shards (a
120,000-shard manifest once cost a relay 117 CPU-s in a polling loop over every shard).
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import random
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ...protocol.messages import ShardRequest
from ..diskspace import DiskFull, DiskWatch
from .errors import DownloadFailed, ShardFetchError, StoreError
from .manifest import WHOLE
from .progress import Progress
from .sources import SourceBook
from .space import SpaceReservations
from .store import InOrderHash, ShardStore, SpareShardWriter, VersionEntry
from .wire import ShardTransport, fetch_into

log = logging.getLogger(__name__)
MIN_PATIENCE_S = 1.0  # a trial transfer is never taken back sooner
HOLD_BACK_S = 1.0
"""After a `seeded` answer, the source is not asked for that shard for this long (doubling
with each such answer, up to HOLD_BACK_MAX_S)."""
HOLD_BACK_MAX_S = 8.0
SWARM_PATIENCE_S = 30.0
"""After the trainer answered `seeded` for a shard, it is not asked for that shard again
while another source (not dropped, not failed on it) holds it, for up to this long from its
first such answer: the follower waits for those holders (trial transfers included) instead.
Then the trainer is asked again as after any hold (its own rule serves an asker that waited
3 holds: seeding.py), so advertisers that hold a shard back cost at most this."""
MAX_FLIGHT_LOG = 4096
"""Transfers remembered in `Downloader.flight_log` (the newest)."""
ENDGAME_MIN_S = 2.0
"""A transfer is raced by a second copy only once it ran this long and is expected to need
this long again (short transfers are not worth the bytes)."""
ENDGAME_FASTER = 3.0
"""... and only from a source expected to deliver the whole shard this many times sooner
than the transfer's time left (by its measured rate, shared among our transfers from it)."""


@dataclass(eq=False)
class _Flight:
    """One shard transfer in progress."""

    peer: str
    started: float
    task: asyncio.Task | None = None
    preempted: bool = False
    lost: bool = False  # the other copy of the shard verified first (endgame): cancelled
    won: bool = False  # an endgame copy that verified first
    writer: object | None = None  # the shard's ShardWriter once the transfer began
    outcome: str = "cancelled"  # how it ended (flight_log): ok, seeded, a failure, ...
    wall: float = 0.0  # its start, wall-clock (flight_log)


class Downloader:
    def __init__(self, store: ShardStore, entry: VersionEntry, transport: ShardTransport,
                 book: SourceBook, cfg, *, on_shard: Callable[[int], None] | None = None,
                 progress: Progress | None = None, disk: DiskWatch | None = None,
                 on_verified: Callable[[str], None] | None = None,
                 space: SpaceReservations | None = None):
        self.store, self.entry, self.transport, self.book, self.cfg = (
            store, entry, transport, book, cfg)
        self.on_shard = on_shard
        self.progress = progress
        self.on_verified = on_verified  # a source delivered a verified shard
        self.disk = disk or DiskWatch("checkpoint download", store.root)
        self.space = space or SpaceReservations(store.root)
        self.in_flight: set[int] = set()
        self.flights: dict[int, _Flight] = {}
        self.spares: dict[int, _Flight] = {}  # endgame: second copies in flight
        self.tried: dict[int, set[str]] = {}  # sources that failed a shard (this round)
        # sources that answered `seeded` for a shard: shard -> {peer: (until, answers)}
        self.held: dict[int, dict[str, tuple[float, int]]] = {}
        self.swarm_since: dict[int, float] = {}  # shard -> the trainer's first `seeded`
        self._held_until: list[float] = []  # heap of the `until`s, for waking idle workers
        self.metrics: Counter[str] = Counter()
        self.last_progress = time.monotonic()
        self.times: dict[str, float] = {}  # wall-clock phases, for benchmarks and logs
        # every transfer's (start, end (wall time), shard, peer, outcome, bytes), the newest
        # MAX_FLIGHT_LOG: where a download's time went (benchmarks)
        self.flight_log: deque[tuple[float, float, int, str, str, int]] = deque(
            maxlen=MAX_FLIGHT_LOG)
        n = entry.manifest.num_shards
        # Different peers start at different shards, so that they can serve each other
        # early. (Tried: starts in the last quarter, so that the in-order whole hash
        # reads back less: no clear gain at 8 clients, and the origin served twice the
        # shards.) Verified shards leave `pending` as the scan meets them.
        start = random.randrange(n)
        self.pending = [i for i in ((start + k) % n for k in range(n)) if i not in entry.have]
        self._stale = 0  # verified shards still in `pending`
        # the whole-concatenation hash, only for manifests that name one ("blake3"); a
        # "blake3-shard-list" checkpoint_hash was checked against the manifest at the gate
        self.whole = InOrderHash(entry) if entry.manifest.hash_algo == WHOLE else None
        self.changed = asyncio.Event()

    # Public --------------------------------------------------------------------------

    def sources_changed(self) -> None:
        """Call after `book.add(...)` so idle workers look again."""
        self.changed.set()

    async def run(self) -> Path:
        m = self.entry.manifest
        self.times["start"] = time.time()
        self.metrics["shards_resumed"] = len(self.entry.have)
        if self.progress is not None:
            self.progress.advance(sum(self.entry.shard_len(i) for i in self.entry.have))
        workers = [asyncio.create_task(self._worker()) for _ in range(self.cfg.parallel_downloads)]
        try:
            await asyncio.gather(*workers)
        finally:
            for w in workers:
                w.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
        self.times["fetched"] = time.time()
        if self.whole is not None:
            self.metrics["whole_hash_live_bytes"] = self.whole.live
        try:
            path = await asyncio.to_thread(self.store.assemble, self.entry, self.whole)
        except (StoreError, OSError) as e:
            if self.progress is not None:
                self.progress.close(ok=False)
            raise DownloadFailed(str(e), reason=getattr(e, "reason", "store_error")) from e
        self.times["assembled"] = time.time()
        if self.whole is not None:
            self.metrics["whole_hash_read_back_bytes"] = self.whole.read_back
            self.metrics["whole_hash_redone"] = int(not self.whole.valid)
        if self.progress is not None:
            self.progress.close(ok=True)
        log.debug("policy %s v%d complete: %d shards, sources %s", m.policy_id, m.version,
                 m.num_shards, self.book.summary())
        return path

    def _logged(self, shard: int, f: _Flight, kind: str = "") -> None:
        received = getattr(f.writer, "received", 0)
        self.flight_log.append((f.wall, time.time(), shard, f.peer, kind + f.outcome,
                                received))

    def _unhashed(self, shard: int) -> None:
        """Shard `shard` did not verify: the whole hash, if any, may have taken its bytes."""
        if self.whole is not None:
            self.whole.failed(shard)

    # Workers -------------------------------------------------------------------------

    def _next_job(self) -> tuple[int, str] | None:
        if not self.book.any_usable():
            return None
        if 2 * self._stale > len(self.pending):  # amortised: O(1) per verified shard
            self.pending = [i for i in self.pending if i not in self.entry.have]
            self._stale = 0
        now = time.monotonic()
        for shard in self.pending:
            if shard in self.in_flight or shard in self.spares or self.entry.has(shard):
                continue
            tried = self.tried.get(shard)
            held = self._held_back(shard, now)
            peer = self.book.pick(shard, tried or frozenset(), held)
            if peer is None and tried and self.book.holders(shard, tried) == 0:
                del self.tried[shard]  # every holder failed it once: let them try again
                peer = self.book.pick(shard, held=held)
            if peer is not None:
                return shard, peer
        return None

    def _held_back(self, shard: int, now: float) -> frozenset[str]:
        """Sources that answered `seeded` for `shard` and are not asked for it yet: while
        their hold-back runs, and the trainer also while other sources hold the shard
        (SWARM_PATIENCE_S)."""
        held = self.held.get(shard)
        if not held:
            return frozenset()
        out = {p for p, (until, _) in held.items() if until > now}
        since = self.swarm_since.get(shard)
        if since is not None and now - since < SWARM_PATIENCE_S:
            tried = self.tried.get(shard, set())
            origins = {p for p in held if p not in out and self.book.sources[p].origin}
            if origins and self.book.holders(shard, tried | origins) > 0:
                out |= origins  # the swarm carries it: wait for its holders
        return frozenset(out)

    def _hold_back(self, shard: int, peer: str) -> None:
        held = self.held.setdefault(shard, {})
        answers = held.get(peer, (0.0, 0))[1] + 1
        now = time.monotonic()
        origin = self.book.sources[peer].origin
        until = now + (min(HOLD_BACK_MAX_S, HOLD_BACK_S * 2 ** (answers - 1)) if origin
                       else HOLD_BACK_S)
        held[peer] = (until, answers)
        heapq.heappush(self._held_until, until)
        if origin and shard not in self.swarm_since:
            self.swarm_since[shard] = now
            heapq.heappush(self._held_until, now + SWARM_PATIENCE_S)

    def _next_hold_end(self, now: float) -> float | None:
        while self._held_until and self._held_until[0] <= now:
            heapq.heappop(self._held_until)
        return self._held_until[0] if self._held_until else None

    async def _idle(self) -> None:
        """Wait until a transfer ends, sources change, a source leaves its cooldown, or
        the stall deadline passes (whichever comes first)."""
        now = time.monotonic()
        wake = self.last_progress + self.cfg.stall_timeout_s
        for ready in (self.book.next_ready(), self._next_hold_end(now)):
            if ready is not None:
                wake = min(wake, ready)
        trials = [f.started for f in self.flights.values()
                  if not f.preempted and not self.book.sources[f.peer].good]
        if trials:
            wake = min(wake, min(trials) + self._patience())
        if self.cfg.endgame and self._endgame():  # a transfer may turn slow enough to race
            wake = min(wake, now + ENDGAME_MIN_S / 2)
        self.changed.clear()
        try:
            async with asyncio.timeout(max(0.01, wake - now)):
                await self.changed.wait()
        except TimeoutError:
            pass

    async def _worker(self) -> None:
        while self.entry.missing_count():
            job = self._next_job()
            if job is None:
                if self.disk.paused:
                    self.last_progress = time.monotonic()  # waiting for space, not stalled
                if time.monotonic() - self.last_progress > self.cfg.stall_timeout_s:
                    raise DownloadFailed(
                        f"no shard verified for {self.cfg.stall_timeout_s:.0f}s; "
                        f"{self.entry.missing_count()} missing; sources "
                        f"{self.book.summary()}", reason="stalled")
                if self._preempt_trial():
                    continue
                spare = self._endgame_job()
                if spare is not None:
                    await self._run_spare(*spare)
                else:
                    await self._idle()
                continue
            shard, peer = job
            self.in_flight.add(shard)
            self.book.started(peer)
            flight = self.flights[shard] = _Flight(peer, time.monotonic(), wall=time.time())
            flight.task = asyncio.create_task(self._fetch(shard, peer, flight))
            try:
                await flight.task
            except DiskFull as e:
                # Not the source's fault: pause this worker until the shard fits again.
                self.metrics["disk_full"] += 1
                self.disk.hit(e)
            except asyncio.CancelledError:
                if not (flight.preempted or flight.lost) or asyncio.current_task().cancelling():
                    raise
                if flight.lost:  # the endgame copy verified first: nothing held against it
                    flight.outcome = "lost"
                    self.metrics["endgame_first_lost"] += 1
                    self.metrics["endgame_bytes_wasted"] += getattr(flight.writer, "received", 0)
                    continue
                flight.outcome = "preempted"
                self.metrics["fail_preempted"] += 1
                self.book.failure(peer, "preempted", shard)  # on trial: cools down
                self.tried.setdefault(shard, set()).add(peer)
            finally:
                self._logged(shard, flight)
                self.flights.pop(shard, None)
                self.in_flight.discard(shard)
                self.book.finished(peer)
                self.changed.set()
            if self.disk.paused:
                await self.disk.wait_for_space(self.entry.shard_len(shard))
                self.last_progress = time.monotonic()  # a pause is not a stall

    # Endgame ----------------------------------------------------------------------------

    def _endgame(self) -> bool:
        """Every missing shard is in flight (first or second copy)."""
        return bool(self.flights) and self.entry.missing_count() <= len(
            self.in_flight | self.spares.keys())

    def _endgame_job(self) -> tuple[int, str] | None:
        """(shard, source) for a second copy of the transfer expected to end last, or None."""
        if not self.cfg.endgame or not self._endgame():
            return None
        now = time.monotonic()
        # never the trainer, nor a source not measured yet: both are left out of the pick
        # (an unmeasured one ranks first there, and once hid every measured holder: the
        # last shard of a 12-node WAN smoke waited 12 s on a 0.15 MiB/s home uplink while
        # a relay that held it had served this follower at 1.8 MiB/s)
        skip = {p for p, s in self.book.sources.items() if s.origin or not s.throughput}
        best, best_left = None, 0.0
        for shard, f in self.flights.items():
            if f.preempted or f.lost or shard in self.spares or f.writer is None:
                continue
            size, elapsed = self.entry.shard_len(shard), now - f.started
            if elapsed < ENDGAME_MIN_S:
                continue
            got = f.writer.received
            left = (size - got) * elapsed / got if got else float("inf")
            if left < ENDGAME_MIN_S or left <= best_left:
                continue
            peer = self.book.pick(shard, {f.peer} | skip | self.tried.get(shard, set()),
                                  self._held_back(shard, now))
            if peer is None:
                continue
            alt = self.book.sources[peer]
            if ENDGAME_FASTER * size * (1 + alt.in_flight) / alt.throughput > left:
                continue
            best, best_left = (shard, peer), left
        return best

    async def _run_spare(self, shard: int, peer: str) -> None:
        self.metrics["endgame_copies"] += 1
        self.book.started(peer)
        spare = self.spares[shard] = _Flight(peer, time.monotonic(), wall=time.time())
        spare.task = asyncio.create_task(self._fetch_spare(shard, peer, spare))
        try:
            await spare.task
        except DiskFull as e:
            self.metrics["disk_full"] += 1
            self.disk.hit(e)
        except asyncio.CancelledError:
            if not spare.lost or asyncio.current_task().cancelling():
                raise
            self.metrics["endgame_spare_lost"] += 1  # the first transfer won the race
        finally:
            self._logged(shard, spare, "spare_")
            if spare.writer is not None:
                self.metrics["endgame_bytes"] += spare.writer.received
                if not spare.won:
                    self.metrics["endgame_bytes_wasted"] += spare.writer.received
            self.spares.pop(shard, None)
            self.book.finished(peer)
            self.changed.set()

    async def _transfer(self, shard: int, peer: str, write) -> None:
        """`shard` from `peer` into `write`, under the configured timeouts and chunk size."""
        m, cfg = self.entry.manifest, self.cfg
        req = ShardRequest(policy_id=m.policy_id, version=m.version, shard=shard)
        await fetch_into(self.transport, peer, req, write,
                         expected_len=self.entry.shard_len(shard),
                         request_timeout=cfg.request_timeout_s,
                         chunk_timeout=cfg.chunk_timeout_s, chunk_size=cfg.chunk_size)

    def _failed(self, shard: int, peer: str, e: ShardFetchError | StoreError, line: str) -> None:
        """A transfer `peer` failed on its own account: counted, not asked for `shard`
        again, and charged in its book."""
        self.metrics[f"fail_{e.reason}"] += 1
        self.tried.setdefault(shard, set()).add(peer)
        self.book.failure(peer, e.reason, shard)
        log.debug(line, shard, peer, e)

    async def _fetch_spare(self, shard: int, peer: str, spare: _Flight) -> None:
        """A second copy of `shard`, raced against the transfer in `self.flights`."""
        writer = spare.writer = SpareShardWriter(self.entry, shard)
        t0 = time.monotonic()
        try:
            await self._transfer(shard, peer, writer.write)
        except (ShardFetchError, StoreError) as e:
            writer.abort()
            spare.outcome = e.reason
            if self.entry.has(shard):
                self.metrics["endgame_spare_lost"] += 1
            elif e.reason == "seeded":
                self._hold_back(shard, peer)
            else:
                self._failed(shard, peer, e, "shard %d (endgame copy) from %s failed: %s")
            return
        except BaseException:
            writer.abort()
            raise
        if self.entry.has(shard):  # the first transfer verified while the last bytes came
            writer.abort()
            spare.outcome = "lost"
            self.metrics["endgame_spare_lost"] += 1
            return
        first = self.flights.get(shard)
        try:
            ok = writer.commit(first.writer if first is not None else None)
        except BaseException:
            if first is not None and first.task is not None:  # its writer may be aborted
                first.lost = True
                first.task.cancel()
            raise
        if not ok:  # the first transfer goes on (aborted only for a verified copy)
            spare.outcome = "corrupt"
            self.metrics["shards_corrupt"] += 1
            self.metrics["bytes_corrupt"] += writer.received
            self.tried.setdefault(shard, set()).add(peer)
            self.book.corrupt(peer)
            log.warning("shard %d from %s does not match its hash: source penalised",
                        shard, peer)
            return
        if first is not None and first.task is not None:
            first.lost = True
            first.task.cancel()
        spare.won = True
        spare.outcome = "ok"
        self.metrics["endgame_won"] += 1
        self._verified(shard, peer, self.entry.shard_len(shard), t0)

    def _patience(self) -> float:
        """How long a trial transfer may hold a shard another source could serve: three
        times what the fastest known-good source takes for a shard (the request timeout
        while none was measured)."""
        rates = [s.throughput for s in self.book.sources.values()
                 if s.good and not s.dropped and s.throughput]
        if not rates:
            return self.cfg.request_timeout_s
        return max(MIN_PATIENCE_S, 3 * self.entry.manifest.shard_size / max(rates))

    def _preempt_trial(self) -> bool:
        """Take back the oldest trial transfer that ran past `_patience` without a byte
        and whose shard a known-good source holds and would serve (the worker then waits
        for it to end). A slow source that sends is not taken back: on a WAN a home uplink
        takes many times longer per shard than the trainer, and is still worth it."""
        now, patience = time.monotonic(), self._patience()
        for shard, f in sorted(self.flights.items(), key=lambda kv: kv[1].started):
            s = self.book.sources[f.peer]
            if f.preempted or s.good or now - f.started < patience \
                    or (f.writer is not None and f.writer.received > 0):
                continue
            held = self._held_back(shard, now)
            if any(o.good and not o.dropped and o.has(shard) and o.peer not in held
                   for o in self.book.sources.values()):
                f.preempted = True
                f.task.cancel()
                log.debug("shard %d: taken back from %s (on trial, no answer in %.1fs)",
                          shard, f.peer, now - f.started)
                return True
        return False

    async def _fetch(self, shard: int, peer: str, flight: _Flight) -> None:
        # DiskFull: the worker pauses, nothing fetched; other downloads' reservations kept
        self.space.check_write(self.entry.key, self.entry.shard_len(shard))
        writer = self.store.begin_shard(self.entry, shard, self.whole)
        flight.writer = writer
        t0 = time.monotonic()
        try:
            # hashing and writing leave the event loop (it keeps serving and receiving);
            # the bytes are hashed as they arrive, not after
            await self._transfer(shard, peer, writer.write)
        except (ShardFetchError, StoreError) as e:
            writer.abort()
            self._unhashed(shard)
            flight.outcome = e.reason
            if self.entry.has(shard):  # the endgame copy verified first: not its fault
                self.metrics["endgame_first_lost"] += 1
                self.metrics["endgame_bytes_wasted"] += writer.received
                return
            if e.reason == "seeded":  # in the swarm already: from a peer that holds it
                self.metrics["seeded"] += 1
                self._hold_back(shard, peer)
                return
            self.metrics["bytes_wasted"] += writer.received
            self._failed(shard, peer, e, "shard %d from %s failed: %s")
            return
        except BaseException:
            writer.abort()
            self._unhashed(shard)
            raise
        finally:
            self.metrics["bytes_fetched"] += writer.received
        self.disk.resumed()
        if self.entry.has(shard):  # the endgame copy went in first
            flight.outcome = "lost"
            self.metrics["endgame_first_lost"] += 1
            self.metrics["endgame_bytes_wasted"] += writer.received
            return
        if not writer.commit():
            flight.outcome = "corrupt"
            self._unhashed(shard)
            self.metrics["shards_corrupt"] += 1
            self.metrics["bytes_corrupt"] += writer.received
            self.tried.setdefault(shard, set()).add(peer)
            self.book.corrupt(peer)
            log.warning("shard %d from %s does not match its hash: source penalised",
                        shard, peer)
            return
        flight.outcome = "ok"
        spare = self.spares.get(shard)
        if spare is not None and spare.task is not None:
            spare.lost = True  # this copy won the endgame race
            spare.task.cancel()
        self._verified(shard, peer, self.entry.shard_len(shard), t0)

    def _verified(self, shard: int, peer: str, size: int, t0: float) -> None:
        self.metrics["shards_ok"] += 1
        self.metrics["bytes_verified"] += size
        self._stale += 1
        self.space.written(self.entry.key, size)
        # it verified after the whole hash's frontier passed its start: hash it now
        if self.whole is not None and self.whole.can_follow():
            asyncio.get_running_loop().run_in_executor(None, self.whole.follow)
        self.last_progress = time.monotonic()
        self.book.success(peer, size, time.monotonic() - t0)
        if self.on_verified is not None:
            self.on_verified(peer)
        if self.progress is not None:
            self.progress.advance(size)
        if self.on_shard is not None:
            self.on_shard(shard)
