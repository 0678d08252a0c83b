"""Announced gossip payloads pulled over authenticated plain TCP (NODE_SPEC 1.5).

A payload above `p2p.inline_payload_max` is gossiped as a signed PayloadAnnounce (hash,
size) and each subscriber pulls the body once. Over libp2p every byte of every copy pays
Noise, yamux framing and a trio/asyncio crossing in Python; here the body travels on a
persistent TCP connection per peer pair, asyncio only. Integrity does not depend on the
channel: the puller checks length and SHA-256 against the signed announce before decoding.

Authentication mirrors the shard data plane (a libp2p request proves the client's peer id):
1. Over libp2p (Noise), the client asks PAYLOAD_TOKEN_PROTOCOL. The answer is msgpack
   `[expiry_ms, mac, port]`, mac = HMAC-SHA256(node secret, DOMAIN || server id || client
   id || expiry_ms); stateless. The client dials `port` at the IP of its libp2p connection.
2. The server sends a fresh 16-byte challenge; the client answers with a hello (u32 BE
   length <= 256, msgpack `[client id, expiry_ms, HMAC-SHA256(mac, proof domain ||
   challenge)]`, tokens.py: the mac itself never crosses the plain connection); the server
   answers one byte 0x01, or closes without a byte when the proof is wrong.
3. Then any number of pulls, one at a time per connection: request = the 32-byte content
   hash; answer = u8 status (0 ok, 1 not held) + u32 BE length + body.

Bounded per connection: the hello within `payload_tcp_auth_timeout_s` (at most
`payload_tcp_max_pending` connections unauthenticated at once), at most
`payload_tcp_conns_per_peer` connections per authenticated peer and 4 x
`payload_tcp_max_pending` authenticated in all, idle connections close
after `payload_tcp_idle_s`, a reader that does not take an answer within
`payload_pull_timeout_s` is cut. Clients bound each pull by the announced size and
`payload_pull_timeout_s`.
"""

from __future__ import annotations

import asyncio
import logging
import struct
import time
from collections.abc import Callable

from ...protocol.codec import pack, unpack
from ...protocol.errors import ProtocolError
from .metrics import P2PMetrics
from .tokens import CHALLENGE_LEN, MAX_HELLO, TokenMac, hello_frame, new_challenge, read_hello

log = logging.getLogger(__name__)

DOMAIN = b"swarm-node/payload-plane/1\x00"
AUTH_ACK = b"\x01"
HASH_LEN = 32
STATUS_OK, STATUS_NOT_HELD = 0, 1
_ANSWER = struct.Struct(">BI")


class PullFailed(Exception):
    """A pull from one source failed. `reason`: not_held, timeout, too_large, unavailable
    (no token, no endpoint, refused: use libp2p for this source), broken."""

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason


# Tokens ------------------------------------------------------------------------------------

class TokenIssuer(TokenMac):
    """Issues and checks payload-plane tokens bound to (this node, the client's peer id)."""

    def __init__(self, peer_id: str, ttl_s: float, secret: bytes | None = None):
        super().__init__(DOMAIN, peer_id, ttl_s, secret)

    def issue(self, client: str, port: int) -> bytes:
        expiry, mac = self.new(client)
        return pack([expiry, mac, port])


def parse_token(raw: bytes) -> tuple[int, bytes, int]:
    """(expiry_ms, mac, port) of a token answer; ProtocolError if malformed."""
    value = unpack(raw, max_size=128)
    if (not isinstance(value, list) or len(value) != 3 or not isinstance(value[0], int)
            or not isinstance(value[1], bytes) or len(value[1]) != 32
            or not isinstance(value[2], int) or not 0 < value[2] < 65536):
        raise ProtocolError("malformed payload-plane token")
    return value[0], value[1], value[2]


# Server ------------------------------------------------------------------------------------

class PayloadServer:
    """Serves held payloads by hash to authenticated peers. `lookup(hash)` returns the bytes
    or None; `allowed(peer)` is the node's peer filter (penalties, bans)."""

    def __init__(self, issuer: TokenIssuer, lookup: Callable[[bytes], bytes | None],
                 allowed: Callable[[str], bool], cfg, metrics: P2PMetrics):
        self.issuer, self.lookup, self.allowed = issuer, lookup, allowed
        self.cfg, self.metrics = cfg, metrics
        self.pending = 0
        self.per_peer: dict[str, int] = {}
        self.server: asyncio.base_events.Server | None = None
        self.port = 0
        self._conns: set[asyncio.StreamWriter] = set()

    def max_authenticated(self) -> int:
        """Authenticated connections held at once, all peers together: peer ids are free to
        make (each needs a libp2p connection only to get its token), so a per-peer cap
        alone would leave the sockets unbounded."""
        return 4 * self.cfg.payload_tcp_max_pending

    async def start(self, host: str, port: int) -> int:
        self.server = await asyncio.start_server(self._on_conn, host, port, limit=MAX_HELLO * 4)
        self.port = self.server.sockets[0].getsockname()[1]
        return self.port

    async def close(self) -> None:
        if self.server is None:
            return
        self.server.close()
        for w in list(self._conns):
            w.transport.abort()
        self.server = None

    async def _on_conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self._conns.add(writer)
        try:
            peer = await self._authenticate(reader, writer)
            if peer is None:
                writer.transport.abort()  # nothing for an unauthenticated client
                return
            try:
                await self._serve(peer, reader, writer)
            finally:
                self.per_peer[peer] -= 1
                if self.per_peer[peer] <= 0:
                    del self.per_peer[peer]
        except Exception as e:  # noqa: BLE001 - one connection must not end the server
            log.debug("payload connection ended: %s: %s", type(e).__name__, e)
        finally:
            self._conns.discard(writer)
            writer.transport.abort()

    async def _authenticate(self, reader, writer) -> str | None:
        if self.pending >= self.cfg.payload_tcp_max_pending:
            self.metrics.inc("payload_tcp_refused_pending")
            return None
        self.pending += 1
        challenge = new_challenge()
        writer.write(challenge)
        try:
            hello = await asyncio.wait_for(read_hello(reader), self.cfg.payload_tcp_auth_timeout_s)
        except TimeoutError:
            hello = None
        finally:
            self.pending -= 1
        if hello is None or not self.issuer.check(*hello, challenge):
            self.metrics.inc("payload_tcp_unauthenticated")
            return None
        peer = hello[0]
        if not self.allowed(peer) or self.per_peer.get(peer, 0) >= self.cfg.payload_tcp_conns_per_peer:
            self.metrics.inc("payload_tcp_refused")
            return None
        if sum(self.per_peer.values()) >= self.max_authenticated():
            self.metrics.inc("payload_tcp_refused_total")
            return None
        self.per_peer[peer] = self.per_peer.get(peer, 0) + 1
        writer.write(AUTH_ACK)
        return peer

    async def _serve(self, peer: str, reader, writer) -> None:
        while True:
            try:
                digest = await asyncio.wait_for(reader.readexactly(HASH_LEN),
                                                self.cfg.payload_tcp_idle_s)
            except (TimeoutError, asyncio.IncompleteReadError, ConnectionError):
                return  # idle or closed by the client: the normal end
            if not self.allowed(peer):
                return
            data = self.lookup(digest)
            if data is None:
                self.metrics.inc("payload_tcp_not_held")
                writer.write(_ANSWER.pack(STATUS_NOT_HELD, 0))
            else:
                writer.write(_ANSWER.pack(STATUS_OK, len(data)))
                writer.write(data)
                self.metrics.inc("payload_tcp_served")
            try:
                await asyncio.wait_for(writer.drain(), self.cfg.payload_pull_timeout_s)
            except TimeoutError:
                self.metrics.inc("payload_tcp_slow_reader")
                return


# Client ------------------------------------------------------------------------------------

class _Conn:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader, self.writer = reader, writer
        self.used = time.monotonic()

    def close(self) -> None:
        self.writer.transport.abort()


class _Source:
    """What the client knows of one serving peer."""

    def __init__(self, slots: int):
        self.token: tuple[bytes, int, int, float] | None = None  # mac, expiry, port, until
        self.idle: list[_Conn] = []
        self.slots = asyncio.Semaphore(slots)
        self.down_until = 0.0
        self.token_request: asyncio.Future | None = None


class PayloadPuller:
    """Pulls payloads from peers over the TCP plane. `request_token(peer)` does the libp2p
    token request; `peer_ip(peer)` returns the IP of our libp2p connection to it (or None)."""

    DOWN_S = 60.0  # after an unusable plane, libp2p for this source this long

    def __init__(self, self_id: str, request_token, peer_ip, cfg, metrics: P2PMetrics):
        self.self_id = self_id
        self.request_token, self.peer_ip = request_token, peer_ip
        self.cfg, self.metrics = cfg, metrics
        self.sources: dict[str, _Source] = {}
        self.paths: dict[str, str] = {}

    def _source(self, peer: str) -> _Source:
        src = self.sources.get(peer)
        if src is None:
            src = self.sources[peer] = _Source(self.cfg.payload_tcp_conns_per_peer)
            while len(self.sources) > 4096:  # bounded, however many peers come and go
                old = self.sources.pop(next(iter(self.sources)))
                for c in old.idle:
                    c.close()
        return src

    def usable(self, peer: str) -> bool:
        return self._source(peer).down_until <= time.monotonic()

    def mark_down(self, peer: str, why: str) -> None:
        src = self._source(peer)
        src.down_until = time.monotonic() + self.DOWN_S
        src.token = None
        for c in src.idle:
            c.close()
        src.idle.clear()
        self._say(peer, "libp2p", why)

    def _say(self, peer: str, path: str, why: str) -> None:
        if self.paths.get(peer) != path:
            self.paths[peer] = path
            log.info("gossip payloads from %s over %s (%s)", peer[-8:], path, why)

    async def pull(self, peer: str, digest: bytes, size: int) -> bytes:
        """The `size` bytes the peer holds under `digest` (not yet hash-checked: the caller
        does). PullFailed on anything else; reason `unavailable` means: use libp2p."""
        src = self._source(peer)
        # The wait for a free connection counts as much as the pull: a source that stalls
        # its pulls must not hold the pulls queued behind them (and the node's pull slots)
        # uncharged for a pull timeout each.
        try:
            await asyncio.wait_for(src.slots.acquire(), self.cfg.payload_pull_timeout_s)
        except TimeoutError:
            self.metrics.inc("payload_tcp_slot_timeouts")
            raise PullFailed(f"no free connection to {peer} within "
                             f"{self.cfg.payload_pull_timeout_s:.0f}s", "timeout") from None
        try:
            conn = self._idle_conn(src)
            if conn is not None:
                try:  # the server may have closed it meanwhile: then once more, fresh
                    return await self._pull_on(peer, src, conn, digest, size)
                except PullFailed as e:
                    if e.reason != "broken":
                        raise
            return await self._pull_on(peer, src, await self._open(peer, src), digest, size)
        finally:
            src.slots.release()

    def _idle_conn(self, src: _Source) -> _Conn | None:
        """A pooled connection young enough that the server has not closed it as idle."""
        while src.idle:
            conn = src.idle.pop()
            if time.monotonic() - conn.used < self.cfg.payload_tcp_idle_s / 2:
                return conn
            conn.close()
        return None

    async def _pull_on(self, peer: str, src: _Source, conn: _Conn, digest: bytes,
                       size: int) -> bytes:
        conn.used = time.monotonic()
        try:
            data = await asyncio.wait_for(self._ask(conn, digest, size),
                                          self.cfg.payload_pull_timeout_s)
        except TimeoutError:
            conn.close()
            raise PullFailed(f"pull from {peer} timed out after "
                             f"{self.cfg.payload_pull_timeout_s:.0f}s", "timeout") from None
        except PullFailed as e:
            if e.reason != "not_held":
                conn.close()
            else:
                src.idle.append(conn)
            raise
        except (asyncio.IncompleteReadError, ConnectionError, OSError) as e:
            conn.close()
            raise PullFailed(f"connection to {peer} broke: {type(e).__name__}",
                             "broken") from None
        src.idle.append(conn)
        return data

    async def _ask(self, conn: _Conn, digest: bytes, size: int) -> bytes:
        conn.writer.write(digest)
        status, length = _ANSWER.unpack(await conn.reader.readexactly(_ANSWER.size))
        if status == STATUS_NOT_HELD:
            raise PullFailed("not held there", "not_held")
        if status != STATUS_OK or length != size:
            # Not a stale connection (that ends before the answer): a server holds only
            # bodies it checked against their announce, so any other length or status is
            # its own doing, never retried (NODE_SPEC: `too_large`, charged to the source).
            raise PullFailed(f"answer of {length} bytes (status {status}) for a payload of "
                             f"{size}", "too_large")
        return await conn.reader.readexactly(length)

    async def warm(self, peer: str) -> None:
        """Token and one authenticated connection to `peer` ready before its first
        announce (called when a libp2p connection to it opens), so that the first payload
        pulled from it waits for no libp2p token request: in the 8-peer gossip benchmark
        the first round, with 56 token requests on its path, took ~3x the later ones.
        Holds one of the source's connection slots while it works, so the server's per-peer
        cap is never exceeded; skipped when a pull is already at work. A failure here marks
        nothing down (the peer may not serve the plane yet): the first pull decides."""
        src = self._source(peer)
        if src.idle or src.token is not None or src.slots.locked():
            return
        await src.slots.acquire()
        try:
            src.idle.append(await self._open(peer, src, mark=False))
            self.metrics.inc("payload_tcp_warmed")
        except PullFailed as e:
            self.metrics.inc("payload_tcp_warm_failed")
            log.debug("payload plane of %s not warmed: %s", peer[-8:], e)
        finally:
            src.slots.release()

    async def _open(self, peer: str, src: _Source, mark: bool = True) -> _Conn:
        """A new authenticated connection. `mark`: an unusable or refusing plane sends this
        source to libp2p for DOWN_S (not for a warm-up, which only tries)."""
        ip = self.peer_ip(peer)
        if ip is None:
            raise PullFailed(f"no connection to {peer} to take its IP from", "unavailable")
        try:
            mac, expiry, port = await self._token(peer, src)
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(ip, port, limit=2 * 1024 * 1024),
                self.cfg.payload_tcp_auth_timeout_s)
        except PullFailed:
            raise
        except Exception as e:  # noqa: BLE001 - any plane failure: libp2p for this source
            if mark:
                self.mark_down(peer, f"payload plane unusable: {type(e).__name__}: {e}")
            raise PullFailed(f"payload plane of {peer}: {type(e).__name__}: {e}",
                             "unavailable") from None
        conn = _Conn(reader, writer)
        try:
            challenge = await asyncio.wait_for(reader.readexactly(CHALLENGE_LEN),
                                               self.cfg.payload_tcp_auth_timeout_s)
            writer.write(hello_frame(self.self_id, expiry, mac, challenge))
            ack = await asyncio.wait_for(reader.readexactly(1), self.cfg.payload_tcp_auth_timeout_s)
            if ack != AUTH_ACK:
                raise ConnectionError("not accepted")
        except Exception as e:  # noqa: BLE001 - refused: libp2p for this source
            conn.close()
            if mark:
                self.mark_down(peer, f"payload plane refused us: {type(e).__name__}")
            raise PullFailed(f"payload plane of {peer} refused: {type(e).__name__}",
                             "unavailable") from None
        self._say(peer, f"TCP {ip}:{port}", "authenticated")
        return conn

    async def _token(self, peer: str, src: _Source) -> tuple[bytes, int, int]:
        if src.token is not None and src.token[3] > time.time() + 5:
            return src.token[:3]
        if src.token_request is None:  # one request per peer, however many pulls wait
            src.token_request = asyncio.ensure_future(self._fetch_token(peer, src))
            src.token_request.add_done_callback(lambda _: setattr(src, "token_request", None))
        return await asyncio.shield(src.token_request)

    async def _fetch_token(self, peer: str, src: _Source) -> tuple[bytes, int, int]:
        expiry, mac, port = parse_token(await self.request_token(peer))
        src.token = (mac, expiry, port, expiry / 1000)
        return mac, expiry, port

    def close(self) -> None:
        for src in self.sources.values():
            for c in src.idle:
                c.close()
            src.idle.clear()
