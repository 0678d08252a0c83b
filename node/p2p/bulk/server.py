"""The bulk plane's server: TLS connections authenticated by both peer ids, handed to the
handler registered for their request kind, with handshake slots and connection limits
(NODE_SPEC 3, "Bulk plane").

Before the handshake nobody is known, only an address (an IPv4 address or an IPv6 /64:
`address_group`): at most `pending_per_ip`
connections per source address and `max_pending` in all may be in their handshake (TLS and
hello within `handshake_timeout_s`); a new connection beyond either takes the place of the
oldest pending one of its own address, or of the address holding the most (counted
`bulk_pending_evicted`). So silent connections cannot keep a newcomer out: they only push
each other out, and each lives `handshake_timeout_s` at most.

After the hello the peer id is proven. At most `conns_per_peer` connections per peer
(more: answered busy), and for peers that are not known (`known(peer)`: a verified history,
a followed trainer, a relay...) `conns_per_ip` per address and `max_conns - known_reserve`
in all. When a limit is reached, a newcomer takes the place of the least recently used
connection of the heaviest user (the address, then the peer id, holding the most
connections) if that user holds at least two more than the newcomer would (connections
are shared max-min fairly among addresses, then identities), else of the connection that
has waited longest for a request, if that is IDLE_EVICT_S or more (an honest client's
pooled connection is only a saving; it reconnects). So 255 connections from many
identities cannot keep out one more, and a known peer always has `known_reserve` places
that unknown peers cannot take (a known peer takes the place of an unknown one when all are
taken). Refusals are an answer (busy, refused), not silence: the channel is authenticated.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
import ssl
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from ...lifecycle import TaskOwner
from ..metrics import P2PMetrics
from ..patches.tcp_tuning import tune_socket
from .conn import BulkConn
from .errors import BulkError
from .hello import (
    ACCEPTED,
    BUSY,
    HEADER,
    MAX_HELLO,
    NO_HANDLER,
    REFUSED,
    new_challenge,
    parse_hello,
)

log = logging.getLogger(__name__)

Handler = Callable[[str, BulkConn], Awaitable[None]]
IDLE_EVICT_S = 1.0  # an authenticated connection waiting this long may give way


@dataclass(eq=False)
class _Pending:
    ip: str
    since: float = field(default_factory=time.monotonic)
    task: asyncio.Task | None = None


@dataclass(eq=False)
class _Authed:
    peer: str
    ip: str
    known: bool
    conn: BulkConn
    task: asyncio.Task


def _set_if_pending(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


def address_group(ip: str) -> str:
    """What the per-address limits count by: an IPv4 address (also when it arrives
    IPv4-mapped on a dual-stack socket), or an IPv6 /64 (one subscriber's usual share)."""
    try:
        addr = ipaddress.ip_address(ip)
    except ValueError:
        return ip
    if isinstance(addr, ipaddress.IPv6Address):
        if addr.ipv4_mapped is not None:
            return str(addr.ipv4_mapped)
        return str(ipaddress.IPv6Network((addr, 64), strict=False))
    return ip


class BulkServer:
    """`allowed(peer)`: the node's peer filter (bans, penalty cuts), asked at the hello and
    before every read of a connection; `known(peer)`: whether the peer has the reserve."""

    def __init__(self, peer_id: str, ctx: ssl.SSLContext, cfg, metrics: P2PMetrics,
                 allowed: Callable[[str], bool] = lambda _: True,
                 known: Callable[[str], bool] = lambda _: False):
        self.peer_id, self.ctx, self.cfg, self.metrics = peer_id, ctx, cfg, metrics
        self.allowed, self.known = allowed, known
        self.handlers: dict[str, Handler] = {}
        self.pending: list[_Pending] = []  # oldest first
        self.conns: list[_Authed] = []
        self._sock: socket.socket | None = None
        # the accept loop and one task per connection (handshake, then its handler)
        self.tasks = TaskOwner("bulk server",
                               on_failure=lambda name, e: metrics.inc("bulk_task_failures"))

    def register(self, kind: str, handler: Handler) -> None:
        """Serve connections of `kind` with `await handler(peer, conn)`; the connection
        closes when it returns."""
        self.handlers[kind] = handler

    async def start(self, host: str, port: int) -> tuple[str, int]:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            sock.listen(1024)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        self.tasks.spawn(self._accept_loop(), "accept")
        return sock.getsockname()[:2]

    async def close(self) -> None:
        await self.tasks.close()
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    # Accepting and handshake slots -------------------------------------------------------

    async def _accept(self) -> tuple[socket.socket, tuple]:
        """The next connection: accepted without blocking once the listening socket is
        readable. (asyncio's `sock_accept`, cancelled at close, can still accept one after
        its future was cancelled, then drop it with an InvalidStateError logged: CPython
        3.11's `_sock_accept`.)"""
        loop = asyncio.get_running_loop()
        while True:
            try:
                return self._sock.accept()
            except (BlockingIOError, InterruptedError):
                pass
            readable = loop.create_future()
            fd = self._sock.fileno()
            loop.add_reader(fd, _set_if_pending, readable)
            try:
                await readable
            finally:
                loop.remove_reader(fd)

    async def _accept_loop(self) -> None:
        while True:
            try:
                sock, addr = await self._accept()
            except OSError as e:  # out of file descriptors, ...: keep the listener
                self.metrics.inc("bulk_accept_errors")
                log.warning("bulk plane: accept failed: %s", e)
                await asyncio.sleep(0.1)  # not a poll: a pause before the next accept
                continue
            sock.setblocking(False)
            tune_socket(sock)
            self.metrics.inc("bulk_accepted")
            pending = _Pending(address_group(addr[0]))
            self._make_room(pending.ip)
            self.pending.append(pending)
            pending.task = self.tasks.spawn(self._serve(sock, pending), "connection")
            # a task cancelled before it ran never reaches its `finally` (evicted in a burst):
            # the socket closes with the task (a no-op once TLS took it over)
            pending.task.add_done_callback(lambda _, s=sock: s.close())

    def _make_room(self, ip: str) -> None:
        """Evict a pending connection if a new one from `ip` would exceed a handshake limit:
        the oldest of `ip`'s own if it is at its share, else the oldest of the address
        holding the most."""
        mine = [p for p in self.pending if p.ip == ip]
        if len(mine) >= self.cfg.pending_per_ip:
            self._evict_pending(mine[0])
        elif len(self.pending) >= self.cfg.max_pending:
            counts = Counter(p.ip for p in self.pending)
            heavy = max(counts, key=counts.__getitem__)
            self._evict_pending(next(p for p in self.pending if p.ip == heavy))

    def _evict_pending(self, pending: _Pending) -> None:
        self.pending.remove(pending)
        self.metrics.inc("bulk_pending_evicted")
        if pending.task is not None:
            pending.task.cancel()

    async def _handshake(self, sock: socket.socket) -> tuple[BulkConn, tuple[str, str] | None]:
        """TLS, then the hello: (connection, (kind, peer) or None if the hello is bad)."""
        conn = BulkConn(self.ctx.wrap_socket(sock, server_side=True,
                                             do_handshake_on_connect=False))
        try:
            await conn.handshake()
            challenge = new_challenge()
            await conn.write(challenge)
            (n,) = HEADER.unpack(await conn.readexactly(HEADER.size))
            if n > MAX_HELLO:
                return conn, None
            return conn, parse_hello(await conn.readexactly(n), self.peer_id, challenge)
        except BaseException:
            conn.abort()
            raise

    async def _serve(self, sock: socket.socket, pending: _Pending) -> None:
        conn = None
        try:
            try:
                async with asyncio.timeout(self.cfg.handshake_timeout_s):
                    conn, hello = await self._handshake(sock)
            except TimeoutError:
                self.metrics.inc("bulk_handshake_timeout")
                return
            except (BulkError, asyncio.IncompleteReadError, OSError, ValueError):
                self.metrics.inc("bulk_bad_handshake")
                return
            finally:
                if pending in self.pending:
                    self.pending.remove(pending)
            if hello is None:
                self.metrics.inc("bulk_bad_hello")  # garbage, a foreign or replayed hello
                return
            kind, peer = hello
            handler = self.handlers.get(kind)
            status = NO_HANDLER if handler is None else self._admit(peer, pending.ip)
            if status != ACCEPTED:
                async with asyncio.timeout(self.cfg.handshake_timeout_s):
                    await conn.write(status)
                return
            await self._run(conn, peer, pending.ip, kind, handler)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - one connection must never end the server
            self.metrics.inc("bulk_conn_errors")
            log.debug("bulk connection from %s ended: %s: %s", pending.ip, type(e).__name__, e)
        finally:
            if conn is not None:
                conn.abort()
            else:
                sock.close()

    async def _run(self, conn: BulkConn, peer: str, ip: str, kind: str, handler) -> None:
        rec = _Authed(peer, ip, self.known(peer), conn, asyncio.current_task())
        self.conns.append(rec)
        self.metrics.inc("bulk_authenticated")
        conn.peer, conn.kind = peer, kind
        conn.check = lambda: self._still_allowed(peer)
        try:
            async with asyncio.timeout(self.cfg.handshake_timeout_s):
                await conn.write(ACCEPTED)
            await handler(peer, conn)
        finally:
            if rec in self.conns:
                self.conns.remove(rec)

    def _still_allowed(self, peer: str) -> bool:
        if self.allowed(peer):
            return True
        self.metrics.inc("bulk_refused_banned")
        return False

    # Authenticated connection limits ---------------------------------------------------

    def _admit(self, peer: str, ip: str) -> bytes:
        """ACCEPTED (room made if needed), BUSY or REFUSED for a new connection of `peer`."""
        if not self.allowed(peer):
            self.metrics.inc("bulk_refused_banned")
            return REFUSED
        if sum(1 for c in self.conns if c.peer == peer) >= self.cfg.conns_per_peer:
            self.metrics.inc("bulk_busy_peer")
            return BUSY
        known = self.known(peer)
        unknown = [c for c in self.conns if not c.known]
        if not known:
            same_ip = [c for c in unknown if c.ip == ip]
            if len(same_ip) >= self.cfg.conns_per_ip and not self._evict_for(peer, ip, same_ip):
                self.metrics.inc("bulk_busy_ip")
                return BUSY
            unknown = [c for c in self.conns if not c.known]
            if (len(unknown) >= self.cfg.max_conns - self.cfg.known_reserve
                    and not self._evict_for(peer, ip, unknown)):
                self.metrics.inc("bulk_busy_total")
                return BUSY
        if len(self.conns) >= self.cfg.max_conns and not (
                known and self._evict_for(peer, ip, [c for c in self.conns if not c.known],
                                          any_user=True)):
            self.metrics.inc("bulk_busy_total")
            return BUSY
        return ACCEPTED

    def _evict_for(self, peer: str, ip: str, among: list[_Authed],
                   any_user: bool = False) -> bool:
        """Close one connection of `among` to make room for `peer` at `ip` (see the module
        doc; `any_user`: the heaviest user gives way whatever the newcomer holds). Whether
        one was closed."""
        if not among:
            return False
        by_ip = Counter(c.ip for c in among)
        heavy_ip = max(by_ip, key=by_ip.__getitem__)
        in_ip = [c for c in among if c.ip == heavy_ip]
        by_peer = Counter(c.peer for c in in_ip)
        heavy_peer = max(by_peer, key=by_peer.__getitem__)
        if heavy_ip != ip:
            heavier = by_ip[heavy_ip] > by_ip[ip] + 1
        else:
            heavier = by_peer[heavy_peer] > by_peer[peer] + 1
        if any_user or heavier:
            victim = min((c for c in in_ip if c.peer == heavy_peer),
                         key=lambda c: c.conn.last_used)
        else:
            victim = max(among, key=lambda c: c.conn.idle_for())
            if victim.conn.idle_for() < IDLE_EVICT_S:
                return False
        self.conns.remove(victim)
        self.metrics.inc("bulk_evicted")
        victim.task.cancel()
        return True
