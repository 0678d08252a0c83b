"""Announced gossip bodies pulled over the bulk plane (NODE_SPEC 3, "Large payloads").

A payload above `p2p.inline_payload_max` is gossiped as a signed PayloadAnnounce (hash,
size) and each subscriber pulls the body once. Over libp2p every byte of every copy pays
Noise, yamux framing and a trio/asyncio crossing in Python; here the body travels on a
pooled bulk-plane connection (kind "body"; TLS, both peer ids proven: bulk/). Integrity
does not rest on the channel alone: the puller checks length and SHA-256 against the
signed announce before decoding.

On a connection, any number of pulls, one at a time: request = the 32-byte content hash;
answer = u8 status (0 ok, 1 not held) + u32 BE length + body. A body the server is
fetching itself (it forwarded the announce before the body arrived) is answered when it
lands, within HOLD_S, instead of "not held". The server closes a
connection idle for `bulk.idle_s` and cuts a reader that does not take an answer within
`p2p.payload_pull_timeout_s`; the client bounds each pull by the announced size and that
timeout, and pulls at most `p2p.payload_pulls_per_peer` bodies from one peer at once. A
pull may carry a first-answer deadline (an unproven announcer asked for its own body,
pubsub.FIRST_ANSWER_S): once the pull has one of the peer's slots, the answer's header must
arrive within it, the connection's set-up included.
"""

from __future__ import annotations

import asyncio
import logging
import struct
from collections import OrderedDict
from collections.abc import Awaitable, Callable

from .bulk import BulkBusy, BulkClient, BulkConn, BulkError, BulkUnavailable
from .metrics import P2PMetrics

log = logging.getLogger(__name__)

KIND = "body"
HASH_LEN = 32
STATUS_OK, STATUS_NOT_HELD = 0, 1
_ANSWER = struct.Struct(">BI")


class PullFailed(Exception):
    """A pull from one source failed. `reason`: not_held, timeout, too_large, unavailable
    (no plane, unreachable, refused, busy: use libp2p for this pull), broken."""

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason


class BodyServer:
    """Serves held bodies by hash on bulk-plane connections of kind "body". `lookup(hash)`
    returns the bytes or None (the plane already checked the peer is allowed, and checks it
    again before every request)."""

    def __init__(self, lookup: Callable[[bytes], bytes | None], idle_s: float,
                 pull_timeout_s: float, metrics: P2PMetrics,
                 coming: Callable[[bytes], Awaitable[bytes | None]] | None = None):
        self.lookup, self.idle_s, self.pull_timeout_s = lookup, idle_s, pull_timeout_s
        self.metrics = metrics
        # a body this node is fetching itself (its announce came first): answered once it
        # lands (bounded by the caller), not "not held" and asked again after a back-off
        self.coming = coming

    async def serve(self, peer: str, conn: BulkConn) -> None:
        while True:
            try:
                async with asyncio.timeout(self.idle_s):  # not wait_for: lifecycle.wait_set
                    digest = await conn.readexactly(HASH_LEN)
            except (TimeoutError, asyncio.IncompleteReadError, BulkError):
                return  # idle, closed by the client, or the peer is refused now
            data = self.lookup(digest)
            if data is None and self.coming is not None:
                data = await self.coming(digest)
                if data is not None:
                    self.metrics.inc("payload_bulk_served_on_arrival")
            try:
                async with asyncio.timeout(self.pull_timeout_s):
                    if data is None:
                        self.metrics.inc("payload_bulk_not_held")
                        await conn.write(_ANSWER.pack(STATUS_NOT_HELD, 0))
                        continue
                    await conn.write(_ANSWER.pack(STATUS_OK, len(data)))
                    await conn.write(data)
            except TimeoutError:
                self.metrics.inc("payload_bulk_slow_reader")
                return
            except BulkError:
                return
            self.metrics.inc("payload_bulk_served")


class BodyPuller:
    """Pulls bodies from peers over the bulk plane (`client`, kind "body")."""

    MAX_PEERS = 4096

    def __init__(self, client: BulkClient, cfg, metrics: P2PMetrics,
                 spawn: Callable[..., object] | None = None):
        self.client, self.cfg, self.metrics = client, cfg, metrics
        self.slots: OrderedDict[str, asyncio.Semaphore] = OrderedDict()
        # the node's task owner: a connection a cancelled pull ended is replaced (warm)
        self.spawn = spawn

    def _slots(self, peer: str) -> asyncio.Semaphore:
        sem = self.slots.get(peer)
        if sem is None:
            sem = self.slots[peer] = asyncio.Semaphore(self.cfg.payload_pulls_per_peer)
            for old in list(self.slots)[:max(0, len(self.slots) - self.MAX_PEERS)]:
                if not self.slots[old].locked():  # one in use stays until released
                    del self.slots[old]
        return sem

    def usable(self, peer: str) -> bool:
        return self.client.usable(peer, KIND)

    def say_libp2p(self, peer: str) -> None:
        """The one log line for a source whose bodies come over libp2p."""
        self.client.say(peer, KIND, "libp2p streams", "bulk plane down for 60 s"
                        if self.client.cfg.fetch else "bulk.fetch is off")

    async def pull(self, peer: str, digest: bytes, size: int,
                   first_answer_s: float | None = None) -> bytes:
        """The `size` bytes the peer holds under `digest` (not yet hash-checked: the caller
        does). PullFailed on anything else; reason `unavailable` means: use libp2p.
        `first_answer_s`: once this pull has one of the peer's slots, the answer must begin
        within this (the connection's set-up included), else PullFailed `timeout`."""
        sem = self._slots(peer)
        # The wait for a free slot counts as much as the pull: a source that stalls its
        # pulls must not hold the pulls queued behind them (and the node's pull slots)
        # uncharged for a pull timeout each.
        try:
            async with asyncio.timeout(self.cfg.payload_pull_timeout_s):
                await sem.acquire()  # not wait_for: a cancel must not be lost (lifecycle.wait_set)
        except TimeoutError:
            self.metrics.inc("payload_bulk_slot_timeouts")
            raise PullFailed(f"no free connection to {peer} within "
                             f"{self.cfg.payload_pull_timeout_s:.0f}s", "timeout") from None
        # not from the ask's start: the wait for our own slot is no fault of the peer's
        first_by = (None if first_answer_s is None
                    else asyncio.get_running_loop().time() + first_answer_s)
        try:
            for fresh in (False, True):
                try:
                    async with asyncio.timeout_at(first_by):
                        conn = await self._open(peer, fresh)
                except TimeoutError:
                    raise PullFailed(f"no connection to {peer} before its first answer "
                                     "was due", "timeout") from None
                try:
                    return await self._pull_on(peer, conn, digest, size, first_by)
                except PullFailed as e:
                    # a pooled connection the server closed meanwhile: once more, fresh
                    if fresh or not conn.reused or e.reason != "broken":
                        raise
            raise AssertionError("unreachable: the fresh attempt returns or raises")
        finally:
            sem.release()

    async def _open(self, peer: str, fresh: bool, mark_down: bool = True) -> BulkConn:
        try:
            return await self.client.open(peer, KIND, fresh=fresh, mark_down=mark_down)
        except (BulkUnavailable, BulkBusy) as e:
            raise PullFailed(f"bulk plane of {peer[-8:]}: {e}", "unavailable") from None

    async def _pull_on(self, peer: str, conn: BulkConn, digest: bytes, size: int,
                       first_by: float | None = None) -> bytes:
        try:
            async with asyncio.timeout(self.cfg.payload_pull_timeout_s):
                data = await self._ask(conn, digest, size, first_by)
        except asyncio.CancelledError:  # a hedged pull won elsewhere, or a push landed:
            conn.abort()  # the answer may be half read, so the connection carries no other
            if self.spawn is not None:
                # ... and a new one is opened now, off the path of the next pull from this
                # peer: opened on that path it cost 5.4 round trips (p50) before the ask in
                # the 12-node simulated WAN, a pooled one none (RESULTS "wan: gossip")
                self.spawn(self.warm(peer), "warm bulk")
            raise
        except TimeoutError:
            conn.abort()
            raise PullFailed(f"pull from {peer} timed out (its answer due within "
                             f"{self.cfg.payload_pull_timeout_s:.0f}s, its first bytes "
                             "by the first-answer deadline if it had one)",
                             "timeout") from None
        except PullFailed as e:
            if e.reason == "not_held":
                conn.reusable()
                await conn.close()
            else:
                conn.abort()
            raise
        except BulkError as e:
            conn.abort()
            if e.reason == "tls_error":  # bytes changed on the path: libp2p for a while
                self.client.mark_down(peer, KIND, f"TLS integrity failure: {e}")
                raise PullFailed(f"pull from {peer}: {e}", "unavailable") from None
            raise PullFailed(f"connection to {peer} broke: {e}", "broken") from None
        except (asyncio.IncompleteReadError, OSError) as e:
            conn.abort()
            raise PullFailed(f"connection to {peer} broke: {type(e).__name__}: {e}",
                             "broken") from None
        conn.reusable()
        await conn.close()  # back to the pool
        return data

    async def _ask(self, conn: BulkConn, digest: bytes, size: int,
                   first_by: float | None = None) -> bytes:
        async with asyncio.timeout_at(first_by):  # None: no deadline of its own
            await conn.write(digest)
            status, length = _ANSWER.unpack(await conn.readexactly(_ANSWER.size))
        if status == STATUS_NOT_HELD:
            raise PullFailed("not held there", "not_held")
        if status != STATUS_OK or length != size:
            # A server holds only bodies it checked against their announce, so any other
            # length or status is its own doing, never retried (NODE_SPEC: `too_large`,
            # charged to the source).
            raise PullFailed(f"answer of {length} bytes (status {status}) for a payload of "
                             f"{size}", "too_large")
        return await conn.readexactly(length)

    async def warm(self, peer: str) -> None:
        """One connection to `peer` ready before its first announce (called when a libp2p
        connection to it opens), so that the first body pulled from it waits for no
        endpoint query and handshake: in the 8-peer gossip benchmark the first round,
        with 56 token requests on its path, took ~3x the later ones. Holds one of the
        peer's slots while it works; skipped when a pull is already at work. A failure
        here marks the peer down only if its endpoint did not answer (behind a NAT: the
        first pull need not wait for that timeout again); else the first pull decides."""
        sem = self._slots(peer)
        if sem.locked() or self.client.kinds[KIND].pool.get(peer):
            return
        async with sem:
            try:
                conn = await self._open(peer, fresh=True, mark_down=False)
            except PullFailed as e:
                self.metrics.inc("payload_bulk_warm_failed")
                log.debug("bulk plane of %s not warmed: %s", peer[-8:], e)
                return
            conn.reusable()
            await conn.close()
            self.metrics.inc("payload_bulk_warmed")
