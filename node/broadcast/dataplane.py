"""The authenticated TCP data plane for shards (the default path; NODE_SPEC 7.2).

libp2p streams cost Noise + Yamux + a trio/asyncio bridge crossing per chunk; shard bytes
need none of that (every shard is checked against the trainer-signed hash). So shards
travel over plain TCP, but only to peers that proved their libp2p identity to us:

1. Over libp2p (Noise-authenticated), the client asks `SHARD_TOKEN_PROTOCOL` for a token.
   The server answers `[expiry_ms, mac]`, mac = HMAC-SHA256(node secret, domain || server
   peer id || client peer id || expiry_ms). Stateless: nothing is stored per token.
2. On the TCP connection the server first sends a fresh 16-byte challenge; the client
   answers with a hello frame (u32 BE length <= 256 + msgpack `[client peer id,
   expiry_ms, HMAC-SHA256(mac, proof domain || challenge)]`, node/p2p/tokens.py: the mac
   itself never crosses the plain connection, so a hello seen on the path opens nothing),
   then sends shard requests as on the libp2p shard protocol, one after another on the
   same connection (idle connections are pooled per source and reused). The server
   recomputes the mac for the claimed peer id and the proof for its challenge; a token
   issued to another peer, an expired one, a replayed hello, garbage or silence closes the
   connection without a byte of shard data. Limits and penalties then apply to the
   authenticated peer.

Bounded per connection: the hello must arrive within `tcp_auth_timeout_s`, a request within
`request_timeout_s`; reads are capped at 1 KiB before authentication; at most
`tcp_max_pending` connections may be unauthenticated at once (more are closed at accept);
at most 2 x `max_uploads_per_peer` authenticated connections per peer and 2 x
`max_uploads_total` in all (more are closed after the hello without a byte: a connection
beyond the upload limits could only idle or be answered `busy`, and each holds a socket).
A token outlives a ban (up to `tcp_token_ttl_s`), so the node's peer filter (bans,
penalties: what libp2p refuses) is asked at the hello and again at every request of an
open connection; a refused peer's connection is closed (counted `refused_banned`).
Bytes go out with `loop.sendfile` (zero-copy `sendfile(2)`) when the upload is not paced.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import Generic, TypeVar

from ...protocol.codec import pack, unpack
from ...protocol.errors import ProtocolError
from ...protocol.ids import SHARD_TOKEN_PROTOCOL
from ..p2p import tokens  # the hello both TCP planes share
from ..p2p.tokens import CHALLENGE_LEN, TokenMac, new_challenge, read_hello
from .transport import DirectTcpStream, PooledStream, TcpStream

log = logging.getLogger(__name__)

DOMAIN = b"swarm-node/dataplane/1\x00"
SERVER_READ_LIMIT = 64 * 1024


class TokenIssuer(TokenMac):
    """Issues and checks data-plane tokens bound to (this node, the client's peer id)."""

    def __init__(self, peer_id: str, ttl_s: float, secret: bytes | None = None):
        super().__init__(DOMAIN, peer_id, ttl_s, secret)

    def issue(self, client: str) -> bytes:
        return pack(list(self.new(client)))


def hello_frame(client: str, token: bytes, challenge: bytes) -> bytes:
    """The hello answering the server's `challenge` with a token answer `[expiry, mac]`."""
    return tokens.hello_frame(client, *parse_token(token), challenge)


def parse_token(token: bytes) -> tuple[int, bytes]:
    """The (expiry_ms, mac) of a token answer; ProtocolError if malformed."""
    value = unpack(token, max_size=128)
    if (not isinstance(value, list) or len(value) != 2 or not isinstance(value[0], int)
            or not isinstance(value[1], bytes) or len(value[1]) != 32):
        raise ProtocolError("malformed data-plane token")
    return value[0], value[1]


class PeerRefused(ConnectionError):
    """The peer of an open data-plane connection is no longer allowed (banned)."""


class AllowedPeerStream(TcpStream):
    """A data-plane connection that reads a request only while its peer is allowed: the
    shard server reads nothing else, so a ban closes the connection at its next request
    (PeerRefused ends the server's loop like a broken connection)."""

    def __init__(self, reader, writer, peer: str, plane: DataPlaneServer):
        super().__init__(reader, writer)
        self.peer, self.plane = peer, plane

    async def read(self, n: int) -> bytes:
        return self._checked(await super().read(n))

    async def readexactly(self, n: int) -> bytes:
        return self._checked(await super().readexactly(n))

    def _checked(self, data: bytes) -> bytes:
        if not self.plane.allowed(self.peer):
            self.plane.metrics["refused_banned"] += 1
            self.writer.transport.abort()
            raise PeerRefused(f"{self.peer} is refused (banned)")
        return data


class DataPlaneServer:
    """Accepts TCP connections, authenticates them, hands them to the shard server.
    `allowed(peer)` is the node's peer filter (bans, penalties); by default all."""

    def __init__(self, issuer: TokenIssuer, handle, cfg,
                 allowed: Callable[[str], bool] = lambda _: True):
        self.issuer, self.handle, self.cfg, self.allowed = issuer, handle, cfg, allowed
        self.pending = 0
        self.conns: Counter[str] = Counter()  # authenticated connections per peer
        self.metrics: Counter[str] = Counter()
        self.server: asyncio.base_events.Server | None = None

    async def start(self, host: str, port: int) -> tuple[str, int]:
        self.server = await asyncio.start_server(self._on_conn, host, port,
                                                 limit=SERVER_READ_LIMIT)
        return self.server.sockets[0].getsockname()[:2]

    def close(self) -> None:
        if self.server is not None:
            self.server.close()

    def _refusal(self, hello: tuple[str, int, bytes] | None, challenge: bytes) -> str | None:
        """Why a connection with this hello is refused (its metric), or None."""
        if hello is None or not self.issuer.check(*hello, challenge):
            return "unauthenticated"
        peer = hello[0]
        if not self.allowed(peer):
            return "refused_banned"
        if self.conns[peer] >= 2 * self.cfg.max_uploads_per_peer:
            return "refused_peer_conns"
        if self.conns.total() >= 2 * self.cfg.max_uploads_total:
            return "refused_conns"
        return None

    async def _on_conn(self, reader, writer) -> None:
        if self.pending >= self.cfg.tcp_max_pending:
            self.metrics["refused_pending"] += 1
            writer.transport.abort()
            return
        self.pending += 1
        challenge = new_challenge()
        writer.write(challenge)
        try:
            hello = await asyncio.wait_for(read_hello(reader), self.cfg.tcp_auth_timeout_s)
        except TimeoutError:
            hello = None
            self.metrics["auth_timeout"] += 1
        finally:
            self.pending -= 1
        refused = self._refusal(hello, challenge)
        if refused is not None:
            self.metrics[refused] += 1
            writer.transport.abort()  # no answer: nothing for a refused client
            return
        peer = hello[0]
        self.metrics["authenticated"] += 1
        self.conns[peer] += 1
        try:
            writer.write(RoutingTransport.AUTH_ACK)
            await self.handle(peer, AllowedPeerStream(reader, writer, peer, self))
        finally:
            self.conns[peer] -= 1
            if self.conns[peer] <= 0:
                del self.conns[peer]


S = TypeVar("S", DirectTcpStream, PooledStream)


class IdlePool(dict[str, list[S]], Generic[S]):
    """Idle streams per source (last in, first out), at most `per_peer` each. A stream is
    handed out again only while idle for less than `max_idle_s` and `usable`; any other
    is closed (`discard`). Shared by the data plane's connections and libp2p streams."""

    def __init__(self, per_peer: int, max_idle_s: float):
        super().__init__()
        self.per_peer, self.max_idle_s = per_peer, max_idle_s

    def take(self, peer: str, usable: Callable[[S], bool] = lambda _: True) -> S | None:
        pool = self.get(peer)
        while pool:
            stream = pool.pop()
            if time.monotonic() - stream.idle_since < self.max_idle_s and usable(stream):
                return stream
            stream.discard()
        return None

    def put(self, peer: str, stream: S, keep: bool = True) -> None:
        pool = self.setdefault(peer, [])
        if keep and len(pool) < self.per_peer:
            pool.append(stream)
        else:
            stream.discard()

    def drop(self, peer: str) -> None:
        for stream in self.pop(peer, []):
            stream.discard()

    def drop_all(self) -> None:
        for peer in list(self):
            self.drop(peer)


class RoutingTransport:
    """Per source: the authenticated TCP data plane when its advert names an endpoint (and
    `tcp_fetch`), else libp2p streams; any data-plane failure (no token, no connection,
    refused) falls back to libp2p for that source for FALLBACK_S. The source is always named
    by its peer ID, so throughput, failures and penalties go to the peer that signed the
    advert. One log line per source and path."""

    FALLBACK_S = 60.0
    AUTH_ACK = b"\x01"
    # Idle authenticated connections kept per source for the next shard request (a server
    # closes an idle one after request_timeout_s, 10 s by default: reuse well before that)
    POOL_PER_PEER = 4
    POOL_IDLE_S = 5.0

    def __init__(self, p2p, use_tcp: bool = True, timeout: float = 10.0):
        self.p2p = p2p
        self.use_tcp = use_tcp
        self.timeout = timeout
        self.endpoints: dict[str, str] = {}
        self.tokens: dict[str, tuple[bytes, float]] = {}
        self._token_requests: dict[str, asyncio.Future] = {}
        self.down: dict[str, float] = {}
        self.paths: dict[str, str] = {}
        self.opened = {"tcp": 0, "tcp_reused": 0, "libp2p": 0, "libp2p_reused": 0}
        self.idle: IdlePool[DirectTcpStream] = IdlePool(self.POOL_PER_PEER, self.POOL_IDLE_S)
        # libp2p shard streams: no liveness peek; kept for less than POOL_IDLE_S, half the
        # servers' default idle bound, and a dead one is retried (wire._open_request)
        self.idle_p2p: IdlePool[PooledStream] = IdlePool(self.POOL_PER_PEER, self.POOL_IDLE_S)

    def set_endpoint(self, peer: str, endpoint: str) -> None:
        host, _, port = endpoint.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            return
        if self.endpoints.get(peer) != endpoint:
            self.endpoints[peer] = endpoint
            self.down.pop(peer, None)
            self.idle.drop(peer)
            while len(self.endpoints) > 4096:  # bounded, whatever adverts claim
                oldest = next(iter(self.endpoints))
                del self.endpoints[oldest]
                self.idle.drop(oldest)

    def _say(self, peer: str, path: str, why: str) -> None:
        if self.paths.get(peer) != path:
            self.paths[peer] = path
            log.info("shards from %s over %s", peer[-8:], f"{path} ({why})")

    def _put_idle(self, peer: str, stream: DirectTcpStream) -> None:
        # a source whose endpoint went away keeps no idle connection
        self.idle.put(peer, stream, keep=self.endpoints.get(peer) is not None)

    def forget_idle(self, peer: str) -> None:
        """A pooled stream to `peer` was found dead: the other idle ones likely are too."""
        self.idle_p2p.drop(peer)

    def close(self) -> None:
        """Close every idle connection and pooled stream."""
        self.idle.drop_all()
        self.idle_p2p.drop_all()

    async def open(self, peer: str, fresh: bool = False):
        """A stream to `peer`'s shard server: a pooled idle one, or (`fresh`, or none idle)
        a new one."""
        endpoint = self.endpoints.get(peer) if self.use_tcp else None
        if endpoint is not None and self.down.get(peer, 0.0) <= time.monotonic():
            stream = None if fresh else self.idle.take(peer, DirectTcpStream.alive)
            if stream is not None:
                self.opened["tcp_reused"] += 1
                return stream
            try:
                stream = await asyncio.wait_for(self._open_tcp(peer, endpoint), self.timeout)
            except Exception as e:  # noqa: BLE001 - any data-plane failure: libp2p instead
                self.down[peer] = time.monotonic() + self.FALLBACK_S
                self.tokens.pop(peer, None)
                self._say(peer, "libp2p streams", f"data plane {endpoint} unusable: "
                                                  f"{type(e).__name__}: {e}")
            else:
                self.opened["tcp"] += 1
                self._say(peer, "the TCP data plane", endpoint)
                return stream
        elif endpoint is None:
            self._say(peer, "libp2p streams", "no data-plane endpoint"
                      if self.use_tcp else "broadcast.tcp_fetch is off")
        stream = None if fresh else self.idle_p2p.take(peer)
        if stream is not None:
            stream.reused = True
            self.opened["libp2p_reused"] += 1
            return stream
        self.opened["libp2p"] += 1
        return PooledStream(await self.p2p.open(peer), lambda s: self.idle_p2p.put(peer, s))

    async def _token(self, peer: str) -> bytes:
        cached = self.tokens.get(peer)
        if cached is not None and cached[1] > time.time() + 5:
            return cached[0]
        # one request per peer, however many transfers start at once (each is a libp2p
        # stream: profiled as a visible share of a client's CPU when 8 asked together)
        pending = self._token_requests.get(peer)
        if pending is None:
            pending = asyncio.ensure_future(self._request_token(peer))
            self._token_requests[peer] = pending
            pending.add_done_callback(lambda _: self._token_requests.pop(peer, None))
        return await asyncio.shield(pending)

    async def _request_token(self, peer: str) -> bytes:
        raw = await self.p2p.node.request(peer, SHARD_TOKEN_PROTOCOL, b"",
                                          timeout=self.timeout, max_response=128)
        expiry_ms, _ = parse_token(raw)
        self.tokens[peer] = (raw, expiry_ms / 1000)
        return raw

    async def _open_tcp(self, peer: str, endpoint: str) -> DirectTcpStream:
        token = await self._token(peer)
        host, _, port = endpoint.rpartition(":")
        stream = await DirectTcpStream.connect(host, int(port))
        try:
            challenge = await stream.readexactly(CHALLENGE_LEN)
            await stream.write(hello_frame(self.p2p.node.peer_id, token, challenge))
            if await stream.readexactly(1) != self.AUTH_ACK:
                raise ConnectionError("not accepted")
        except BaseException:
            await stream.close()
            raise
        stream.release = lambda s: self._put_idle(peer, s)
        return stream
