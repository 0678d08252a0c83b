"""The bulk plane's client: one per node, for every request kind. Pooled connections per
(peer, kind), the server's identity checked from its certificate, ours proven by the hello,
and the libp2p fallback decided here: a peer whose plane cannot be used (none, unreachable,
another identity at that address, refused us) is left to libp2p streams for DOWN_S, twice
as long after each further failure in a row (at most MAX_DOWN_S: a port that is never
forwarded costs one connect timeout an hour, not one a minute)."""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from ..patches.tcp_tuning import tune_socket
from .cert import CertificateError, client_context, peer_id_of
from .conn import BulkConn, RxStats
from .errors import BulkBusy, BulkError, BulkUnavailable
from .hello import ACCEPTED, BUSY, CHALLENGE_LEN, STATUS, hello_frame
from .pool import IdlePool

log = logging.getLogger(__name__)

Endpoint = tuple[str, int]
Query = Callable[[str], Awaitable[Endpoint | None]]


def parse_endpoint(endpoint: str) -> Endpoint | None:
    """("host", port) of "host:port" ("[v6]:port" too); None if malformed."""
    host, _, port = endpoint.rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    return host, int(port)


@dataclass
class _Kind:
    label: str  # what the path log line calls the bytes: "shards", "gossip bodies"
    pool: IdlePool[BulkConn]


class BulkClient:
    """`query(peer)` asks the peer over libp2p where its plane listens (plane.py): (host,
    port), host "" meaning the address of our libp2p connection, or None for no plane."""

    DOWN_S = 60.0
    MAX_DOWN_S = 3600.0
    MAX_PEERS = 4096

    def __init__(self, identity, cfg, query: Query):
        self.identity, self.cfg, self.query = identity, cfg, query
        self.ctx = client_context()
        self.kinds: dict[str, _Kind] = {}
        self.endpoints: dict[str, Endpoint] = {}  # the peer signed them (adverts)
        self._resolved: dict[str, tuple[Endpoint | None, float]] = {}
        self._resolving: dict[str, asyncio.Future] = {}
        self.down: dict[tuple[str, str], float] = {}
        self._strikes: dict[tuple[str, str], int] = {}  # unusable in a row
        self.paths: dict[tuple[str, str], str] = {}
        self.opened: Counter[str] = Counter()  # connections by kind (new, reused, busy...)
        self.rx = RxStats()  # body reads of our connections

    def counters(self) -> dict[str, int]:
        """What this client did, by name, for /metrics (`swarm_node_bulk_total`):
        connections opened per kind (`shards`, `shards_reused`, `shards_busy`, ...) and the
        body reads of the receiving threads (`rx_calls`, `rx_bytes`)."""
        out = dict(self.opened)
        out.update({f"rx_{k}": n for k, n in self.rx.as_dict().items()})
        return out

    def add_kind(self, kind: str, label: str, per_peer: int, max_idle_s: float) -> None:
        """Pool up to `per_peer` idle connections of `kind` per peer, each reused while idle
        for less than `max_idle_s` (below the server's idle bound for that kind)."""
        self.kinds[kind] = _Kind(label, IdlePool(per_peer, max_idle_s))

    # What we know of peers -----------------------------------------------------------

    def set_endpoint(self, peer: str, endpoint: str) -> None:
        """The endpoint `peer` announced (signed) for its plane."""
        where = parse_endpoint(endpoint)
        if where is None or self.endpoints.get(peer) == where:
            return
        self.endpoints.pop(peer, None)
        self.endpoints[peer] = where  # newest last: the oldest is forgotten first
        for k in self.kinds:
            self.down.pop((peer, k), None)
            self._strikes.pop((peer, k), None)
            self.kinds[k].pool.drop(peer)
        while len(self.endpoints) > self.MAX_PEERS:
            self.endpoints.pop(next(iter(self.endpoints)))

    def usable(self, peer: str, kind: str) -> bool:
        return self.cfg.fetch and self.down.get((peer, kind), 0.0) <= time.monotonic()

    def mark_down(self, peer: str, kind: str, why: str) -> None:
        """Use libp2p for `peer`'s `kind` requests for DOWN_S (doubling while it stays
        unusable)."""
        key = (peer, kind)
        strikes = self._strikes[key] = self._strikes.pop(key, 0) + 1
        self.down[key] = time.monotonic() + min(self.MAX_DOWN_S,
                                                self.DOWN_S * 2 ** (strikes - 1))
        for d in (self.down, self._strikes):
            while len(d) > self.MAX_PEERS:
                d.pop(next(iter(d)))
        self._resolved.pop(peer, None)
        self.kinds[kind].pool.drop(peer)
        self.say(peer, kind, "libp2p streams", why)

    def say(self, peer: str, kind: str, path: str, why: str) -> None:
        """One log line per source and kind whenever its path changes."""
        key = (peer, kind)
        if self.paths.get(key) != path:
            self.paths[key] = path
            while len(self.paths) > self.MAX_PEERS:
                self.paths.pop(next(iter(self.paths)))
            log.info("%s from %s over %s (%s)", self.kinds[kind].label, peer[-8:], path, why)

    def forget_idle(self, peer: str, kind: str) -> None:
        """A pooled connection to `peer` was found dead: the other idle ones likely are."""
        self.kinds[kind].pool.drop(peer)

    def close(self) -> None:
        for k in self.kinds.values():
            k.pool.drop_all()

    # Connections ---------------------------------------------------------------------

    async def open(self, peer: str, kind: str, fresh: bool = False,
                   mark_down: bool = True) -> BulkConn:
        """A connection to `peer` for `kind`: an idle pooled one (unless `fresh`), else a
        new one. BulkUnavailable (the peer is then left to libp2p for DOWN_S, if
        `mark_down` or if its endpoint did not answer: reason `unreachable`), BulkBusy (its
        limits for us are reached now: nothing marked)."""
        pool = self.kinds[kind].pool
        conn = None if fresh else pool.take(peer, BulkConn.alive)
        if conn is not None:
            conn.reused = True
            self.opened[f"{kind}_reused"] += 1
            return conn
        try:
            where = await self._endpoint(peer)
            conn = await self._connect_retrying(peer, kind, where)
        except BulkBusy:
            self.opened[f"{kind}_busy"] += 1
            raise
        except BulkUnavailable as e:
            if mark_down or e.reason == "unreachable":  # a timeout is worth paying once
                self.mark_down(peer, kind, str(e))
            raise
        self.opened[kind] += 1
        self._strikes.pop((peer, kind), None)
        self.say(peer, kind, "the bulk plane", f"{where[0]}:{where[1]}, TLS")
        conn.release = lambda c: pool.put(peer, c, keep=self.usable(peer, kind))
        return conn

    async def _endpoint(self, peer: str) -> Endpoint:
        where = self.endpoints.get(peer)
        if where is not None:
            return where
        cached = self._resolved.get(peer)
        if cached is None or cached[1] <= time.monotonic():
            # one query per peer, however many requests start at once
            pending = self._resolving.get(peer)
            if pending is None:
                pending = asyncio.ensure_future(self._resolve(peer))
                self._resolving[peer] = pending
                pending.add_done_callback(lambda _: self._resolving.pop(peer, None))
            cached = await asyncio.shield(pending)
        if cached[0] is None:
            raise BulkUnavailable(f"{peer[-8:]} has no bulk plane we can reach")
        return cached[0]

    async def _resolve(self, peer: str) -> tuple[Endpoint | None, float]:
        try:
            where = await self.query(peer)
        except Exception as e:  # noqa: BLE001 - any failure: no plane known, libp2p
            log.debug("bulk endpoint of %s unknown: %s", peer[-8:], e)
            where = None
        entry = (where, time.monotonic() + (3600.0 if where else self.DOWN_S))
        self._resolved[peer] = entry
        while len(self._resolved) > self.MAX_PEERS:
            self._resolved.pop(next(iter(self._resolved)))
        return entry

    async def _connect_retrying(self, peer: str, kind: str, where: Endpoint) -> BulkConn:
        """`_connect`, once more if the server closed before answering the hello (under a
        handshake flood our pending connection can be pushed out: not a refusal)."""
        try:
            return await self._connect(peer, kind, where)
        except BulkError as e:
            if e.reason != "closed_early":
                raise
            self.opened[f"{kind}_retried"] += 1
        try:
            return await self._connect(peer, kind, where)
        except BulkError as e:
            if e.reason != "closed_early":
                raise
            raise BulkUnavailable(f"bulk plane {where[0]}:{where[1]} closed before "
                                  "answering") from None

    async def _connect(self, peer: str, kind: str, where: Endpoint) -> BulkConn:
        try:
            async with asyncio.timeout(self.cfg.handshake_timeout_s):
                return await self._handshake(peer, kind, where)
        except TimeoutError:
            raise BulkUnavailable(f"bulk plane {where[0]}:{where[1]}: no answer within "
                                  f"{self.cfg.handshake_timeout_s:.0f}s",
                                  reason="unreachable") from None
        except asyncio.IncompleteReadError:
            raise BulkError("closed early", reason="closed_early") from None
        except CertificateError as e:
            raise BulkUnavailable(f"bulk plane {where[0]}:{where[1]} is not {peer[-8:]}'s: "
                                  f"{e}") from None
        except BulkError as e:
            if isinstance(e, BulkBusy | BulkUnavailable):
                raise
            if e.reason == "broken":
                raise BulkError("closed early", reason="closed_early") from None
            raise BulkUnavailable(f"bulk plane {where[0]}:{where[1]}: {e}") from None
        except OSError as e:
            raise BulkUnavailable(f"bulk plane {where[0]}:{where[1]}: "
                                  f"{e.strerror or type(e).__name__}",
                                  reason="unreachable") from None

    async def _handshake(self, peer: str, kind: str, where: Endpoint) -> BulkConn:
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(where[0], where[1], type=socket.SOCK_STREAM)
        family, socktype, proto, _, addr = infos[0]
        sock = socket.socket(family, socktype, proto)
        sock.setblocking(False)
        tune_socket(sock)
        try:
            await loop.sock_connect(sock, addr)
            tls = self.ctx.wrap_socket(sock, do_handshake_on_connect=False)
        except BaseException:
            sock.close()
            raise
        conn = BulkConn(tls, peer, kind, rx=self.rx)
        try:
            await conn.handshake()
            if peer_id_of(tls.getpeercert(binary_form=True)) != peer:
                raise CertificateError("its certificate names another peer")
            challenge = await conn.readexactly(CHALLENGE_LEN)
            await conn.write(hello_frame(self.identity, peer, kind, challenge))
            status = await conn.readexactly(1)
        except BaseException:
            conn.abort()
            raise
        if status != ACCEPTED:
            conn.abort()
            what = STATUS.get(status, f"status {status!r}")
            if status == BUSY:
                raise BulkBusy(f"bulk plane of {peer[-8:]} is busy for us")
            raise BulkUnavailable(f"bulk plane {where[0]}:{where[1]} answered {what}")
        return conn
