"""The bulk plane (node/p2p/bulk): TLS bound to both peer ids, refusals, bans, an on-path
attacker, and the handshake slots and connection limits under floods from a real attacker
process. Real sockets on loopback; the request kind here is a small echo."""

from __future__ import annotations

import asyncio
import datetime
import json
import os
import socket
import ssl
import struct
import subprocess
import sys
import time

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from swarm_node.node.config import BulkSection
from swarm_node.node.identity import Identity
from swarm_node.node.p2p.bulk import BulkClient, BulkError, BulkServer, BulkUnavailable
from swarm_node.node.p2p.bulk.cert import (
    EXTENSION_OID,
    SIGNATURE_PREFIX,
    CertificateError,
    client_context,
    encode_signed_key,
    make_certificate,
    peer_id_of,
    server_context,
)
from swarm_node.node.p2p.bulk.hello import (
    ACCEPTED,
    BUSY,
    CHALLENGE_LEN,
    HEADER,
    NO_HANDLER,
    REFUSED,
    hello_frame,
    new_challenge,
    parse_hello,
)
from swarm_node.node.p2p.metrics import P2PMetrics
from swarm_node.node.testing.onpath import Proxy
from swarm_node.protocol.codec import pack, unpack

from tests.waiting import async_wait_until

from .conftest import wait_until

SERVER, ME = Identity.generate(), Identity.generate()
KIND = "echo"


async def echo(peer: str, conn) -> None:
    """Kind "echo": u32 BE length + bytes, answered with `peer[-8:]` + the same bytes."""
    while True:
        try:
            (n,) = struct.unpack(">I", await conn.readexactly(4))
            data = await conn.readexactly(n)
        except (asyncio.IncompleteReadError, BulkError):
            return
        await conn.write(peer[-8:].encode() + data)


async def ask(conn, data: bytes) -> bytes:
    await conn.write(struct.pack(">I", len(data)) + data)
    return await asyncio.wait_for(conn.readexactly(8 + len(data)), 20)


class Plane:
    """A BulkServer of SERVER serving `echo`, and clients of it."""

    def __init__(self, **cfg):
        self.cfg = BulkSection(**{"handshake_timeout_s": 2.0, **cfg})
        self.metrics = P2PMetrics()
        self.banned: set[str] = set()
        self.known: set[str] = set()
        self.server = BulkServer(SERVER.peer_id, server_context(SERVER), self.cfg,
                                 self.metrics, allowed=lambda p: p not in self.banned,
                                 known=self.known.__contains__)
        self.server.register(KIND, echo)
        self.clients: list[BulkClient] = []

    async def __aenter__(self):
        _, self.port = await self.server.start("127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc):
        for c in self.clients:
            c.close()
        await self.server.close()

    def client(self, ident: Identity, as_peer: str | None = None) -> BulkClient:
        """A client of `ident` that knows this server's endpoint (as `as_peer`'s)."""
        async def no_query(peer):
            return None
        c = BulkClient(ident, self.cfg, no_query)
        c.add_kind(KIND, "echoes", 4, 5.0)
        c.set_endpoint(as_peer or SERVER.peer_id, f"127.0.0.1:{self.port}")
        self.clients.append(c)
        return c


def forged_certificate(key_of: Identity, signer: Identity, spki_from=None) -> bytes:
    """A self-signed certificate whose libp2p extension names `key_of`'s key, signed by
    `signer` over the SubjectPublicKeyInfo of `spki_from` (default: its own key)."""
    key = ec.generate_private_key(ec.SECP256R1())
    spki = (spki_from or key.public_key()).public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    ext = encode_signed_key(bytes([8, 1, 0x12, 0x20]) + key_of.public_bytes,
                            signer.sign(SIGNATURE_PREFIX + spki))
    now = datetime.datetime.now(datetime.UTC)
    name = x509.Name([x509.NameAttribute(NameOID.SERIAL_NUMBER, "1")])
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(1)
            .not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.UnrecognizedExtension(EXTENSION_OID, ext), critical=True)
            .sign(key, hashes.SHA256()))
    return cert.public_bytes(serialization.Encoding.DER)


def test_a_certificate_proves_its_peer_id_and_nothing_else():
    pem, _ = make_certificate(SERVER)
    der = x509.load_pem_x509_certificate(pem).public_bytes(serialization.Encoding.DER)
    assert peer_id_of(der) == SERVER.peer_id
    other = ec.generate_private_key(ec.SECP256R1()).public_key()
    bad = [forged_certificate(SERVER, signer=ME),  # names SERVER, signed by another key
           forged_certificate(SERVER, signer=SERVER, spki_from=other),  # for another key
           b"", b"\x30\x03\x02\x01\x00"]
    rng = __import__("random").Random(1)
    for _ in range(200):  # damaged certificates: our error, never another exception
        d = bytearray(der)
        d[rng.randrange(len(d))] ^= 1 << rng.randrange(8)
        bad.append(bytes(d[:rng.randrange(len(d) + 1)] if rng.random() < 0.3 else d))
    for cert in bad:
        try:
            assert peer_id_of(cert) == SERVER.peer_id  # a flip in padding may still prove it
        except CertificateError:
            pass
    assert peer_id_of(forged_certificate(ME, signer=ME)) == ME.peer_id  # the helper is sound
    for cert in bad[:4]:
        with pytest.raises(CertificateError):
            peer_id_of(cert)


def test_a_hello_is_bound_to_the_server_the_challenge_and_the_kind():
    c = new_challenge()
    body = hello_frame(ME, SERVER.peer_id, KIND, c)[HEADER.size:]
    assert parse_hello(body, SERVER.peer_id, c) == (KIND, ME.peer_id)
    assert parse_hello(body, SERVER.peer_id, new_challenge()) is None  # replayed elsewhere
    assert parse_hello(body, ME.peer_id, c) is None  # forwarded to another server
    _, peer, sig = unpack(hello_frame(ME, SERVER.peer_id, "shard", c)[HEADER.size:],
                          max_size=512)
    assert parse_hello(pack([KIND, peer, sig]), SERVER.peer_id, c) is None  # another kind's
    for junk in (b"", b"\xc1", os.urandom(100), body[:-1]):
        assert parse_hello(junk, SERVER.peer_id, c) is None


async def test_round_trip_pooled_and_authenticated_both_ways():
    async with Plane() as p:
        client = p.client(ME)
        conn = await client.open(SERVER.peer_id, KIND)
        assert await ask(conn, b"hi") == ME.peer_id[-8:].encode() + b"hi"  # it knows us
        conn.reusable()
        await conn.close()  # pooled
        again = await client.open(SERVER.peer_id, KIND)
        assert again is conn and again.reused
        assert await ask(again, b"x" * 200_000) == ME.peer_id[-8:].encode() + b"x" * 200_000
        assert client.opened == {KIND: 1, f"{KIND}_reused": 1}
        assert p.metrics["bulk_authenticated"] == 1
        again.abort()


async def test_the_client_refuses_an_address_that_is_not_the_peers():
    async with Plane() as p:
        other = Identity.generate().peer_id
        client = p.client(ME, as_peer=other)  # SERVER's address, said to be `other`'s
        with pytest.raises(BulkUnavailable, match="not .*'s"):
            await client.open(other, KIND)
        assert not client.usable(other, KIND)  # libp2p for it now
        # we sent no hello to whoever answered there
        await wait_until(lambda: p.metrics["bulk_bad_handshake"] == 1, 10, what="the close")
        assert p.metrics["bulk_authenticated"] == 0


async def tls_exchange(port: int, hello) -> bytes:
    """TLS to the plane; send `hello(challenge)`; what it answers before closing."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=client_context(),
                                                   server_hostname="")
    try:
        challenge = await reader.readexactly(CHALLENGE_LEN)
        writer.write(hello(challenge))
        return await asyncio.wait_for(reader.read(100), 20)
    except (ConnectionError, ssl.SSLError):
        return b""
    finally:
        writer.transport.abort()


def raw_all(port: int, data: bytes) -> bytes:
    """Send `data` on a plain connection; everything the plane sends until it closes."""
    out = b""
    with socket.create_connection(("127.0.0.1", port), timeout=20) as s:
        s.sendall(data)
        try:
            while part := s.recv(1 << 16):
                out += part
        except ConnectionResetError:
            pass
    return out


def raw_exchange(port: int, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=20) as s:
        s.sendall(data)
        try:
            return s.recv(100)
        except ConnectionResetError:
            return b""


async def test_the_server_refuses_what_is_not_authenticated():
    async with Plane() as p:
        seen = []
        good = await tls_exchange(p.port, lambda c: seen.append(
            hello_frame(ME, SERVER.peer_id, KIND, c)) or seen[-1])
        assert good == ACCEPTED
        attempts = {
            "replayed": lambda c: seen[0],  # that hello on a new connection
            "for another server": lambda c: hello_frame(ME, ME.peer_id, KIND, c),
            "garbage": lambda c: HEADER.pack(10) + os.urandom(10),
            "oversized": lambda c: HEADER.pack(60_000) + b"x" * 1000,
        }
        for what, hello in attempts.items():
            assert await tls_exchange(p.port, hello) == b"", what
        assert await tls_exchange(p.port, lambda c: hello_frame(
            ME, SERVER.peer_id, "nope", c)) == NO_HANDLER
        # no TLS at all: plain bytes, then silence past the handshake timeout
        for data in (b"GET / HTTP/1.0\r\n\r\n", HEADER.pack(5) + b"hello", b""):
            assert await asyncio.to_thread(raw_exchange, p.port, data) == b""
        m = p.metrics
        assert m["bulk_bad_hello"] == 4 and m["bulk_authenticated"] == 1
        assert m["bulk_bad_handshake"] + m["bulk_handshake_timeout"] == 3
        assert m["bulk_handshake_timeout"] >= 1


async def test_a_banned_peer_is_refused_at_its_next_request_and_at_the_hello():
    async with Plane() as p:
        client = p.client(ME)
        busy, idle = [await client.open(SERVER.peer_id, KIND, fresh=True) for _ in range(2)]
        assert await ask(busy, b"a")
        p.banned.add(ME.peer_id)
        for conn in (busy, idle):  # closed at the next request, not answered
            await conn.write(struct.pack(">I", 1) + b"b")
            assert await asyncio.wait_for(conn.read(100), 20) == b""
        with pytest.raises(BulkUnavailable, match="refused"):
            await client.open(SERVER.peer_id, KIND, fresh=True)
        assert await tls_exchange(p.port, lambda c: hello_frame(
            ME, SERVER.peer_id, KIND, c)) == REFUSED
        assert p.metrics["bulk_refused_banned"] == 4


async def test_an_on_path_attacker_cannot_read_corrupt_or_replay():
    async with Plane() as p:
        marker = b"secret-shard-bytes-" * 100
        proxy = Proxy(p.port)
        port = await proxy.start()
        client = p.client(ME)
        client.set_endpoint(SERVER.peer_id, f"127.0.0.1:{port}")
        conn = await client.open(SERVER.peer_id, KIND)
        assert (await ask(conn, marker)).endswith(marker)
        conn.abort()
        assert marker[:19] not in bytes(proxy.seen["up"]) + bytes(proxy.seen["down"])
        # the recorded client bytes, replayed to the server: its handshake has a new
        # random, so the old Finished fails and the connection closes, nothing accepted
        replay = bytes(proxy.seen["up"])
        answer = await asyncio.to_thread(raw_all, p.port, replay)
        assert ACCEPTED not in answer[-1:] and p.metrics["bulk_bad_handshake"] == 1
        assert p.metrics["bulk_authenticated"] == 1
        # one bit flipped in the answer: the client's TLS refuses the record
        flipper = Proxy(p.port, flip_after=len(proxy.seen["down"]) - 20)
        client.set_endpoint(SERVER.peer_id, f"127.0.0.1:{await flipper.start()}")
        conn = await client.open(SERVER.peer_id, KIND, fresh=True)
        with pytest.raises(BulkError) as e:
            await ask(conn, marker)
        assert e.value.reason == "tls_error"
        conn.abort()
        proxy.close()
        flipper.close()


class FloodProcess:
    """node/testing/bulk_flood.py as a real process against the plane."""

    def __init__(self, port: int, *args: str):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "swarm_node.node.testing.bulk_flood",
             "--target", f"127.0.0.1:{port}", "--server-peer", SERVER.peer_id, "--kind",
             KIND, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    async def report(self, ask_stats: bool = False) -> dict:
        if ask_stats:
            self.proc.stdin.write("stats\n")
            self.proc.stdin.flush()
        line = await asyncio.wait_for(asyncio.to_thread(self.proc.stdout.readline), 120)
        return json.loads(line)

    def stop(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


async def round_trip_within(client, deadline_s: float = 30) -> int:
    """Round trips until one succeeds over the plane (busy answers retried, as the next
    request would); returns how many tries it took."""
    loop = asyncio.get_running_loop()
    end, tries = loop.time() + deadline_s, 0
    while True:
        tries += 1
        try:
            conn = await client.open(SERVER.peer_id, KIND, fresh=True, mark_down=False)
            assert (await ask(conn, b"ping")).endswith(b"ping")
            conn.reusable()
            await conn.close()
            return tries
        except BulkError:
            assert loop.time() < end, f"no round trip in {deadline_s}s ({tries} tries)"
            await asyncio.sleep(0.1)  # the next request of a real client, not a poll


async def test_a_silent_flood_does_not_lock_out_a_newcomer():
    # every handshake slot is the attacker's to take (no per-address share): a newcomer
    # still gets in, since the oldest pending connection of the heaviest address gives way
    async with Plane(max_pending=64, pending_per_ip=64) as p:
        # 80 silent connections, kept topped up, from another address (an attacker's host)
        flood = FloodProcess(p.port, "--mode", "silent", "--conns", "80",
                             "--source-ip", "127.0.0.2")
        try:
            assert (await flood.report())["opened"] >= 80
            assert await round_trip_within(p.client(ME)) == 1
            # the 80 were accepted before it (one listen queue): at most 64 still wait, the
            # others were pushed out (or, on a slow machine, timed out first)
            assert len(p.server.pending) <= 64
            assert p.metrics["bulk_pending_evicted"] + p.metrics["bulk_handshake_timeout"] >= 16

            async def closes_seen() -> bool:  # the flood process reads its closes in time
                return (await flood.report(ask_stats=True))["closed_by_server"] >= 16
            await async_wait_until(closes_seen, 30, "the flood to see 16 closes", interval=0.2)
        finally:
            flood.stop()


async def test_an_identity_flood_does_not_lock_out_a_newcomer_or_a_known_peer():
    async with Plane(max_conns=256, conns_per_ip=64, known_reserve=64) as p:
        known = Identity.generate()
        p.known.add(known.peer_id)
        kc = p.client(known)
        pooled = [await kc.open(SERVER.peer_id, KIND, fresh=True) for _ in range(2)]
        # 255 authenticated connections of 128 fresh identities, kept topped up, from the
        # same address as the honest peers (one machine: the harder case)
        flood = FloodProcess(p.port, "--mode", "hello", "--conns", "255", "--identities",
                             "128")
        try:
            ready = await flood.report()  # every connection has its status
            assert ready["settled"] == 255, ready
            # each was answered; an unknown address holds its share (64) at most: newcomers
            # beyond it are refused busy or, once the flood's connections idle 1 s (a slow
            # machine), take the place of one of them
            assert ready.get("accepted", 0) >= 64, ready
            assert ready.get("busy", 0) > 0 or p.metrics["bulk_evicted"] > 0, ready
            assert len([c for c in p.server.conns if not c.known]) <= 64
            assert len(p.server.conns) <= 256
            assert await round_trip_within(p.client(ME)) <= 20  # the newcomer
            for conn in pooled:  # the known peer's connections were never taken
                assert (await ask(conn, b"k")).endswith(b"k")
            assert await round_trip_within(kc) == 1
            assert p.metrics["bulk_evicted"] > 0
        finally:
            flood.stop()
            for conn in pooled:
                conn.abort()


async def test_connection_limits_share_fairly_and_keep_the_reserve():
    async with Plane(max_conns=4, known_reserve=1, conns_per_peer=2, conns_per_ip=4) as p:
        held = []

        async def hello(ident: Identity) -> bytes:
            """A new connection of `ident`, kept open: the plane's answer."""
            reader, writer = await asyncio.open_connection(
                "127.0.0.1", p.port, ssl=client_context(), server_hostname="")
            held.append(writer)
            writer.write(hello_frame(ident, SERVER.peer_id, KIND,
                                     await reader.readexactly(CHALLENGE_LEN)))
            return await asyncio.wait_for(reader.read(1), 20)

        a, b, c, d, k1, k2 = (Identity.generate() for _ in range(6))
        p.known.update({k1.peer_id, k2.peer_id})
        try:
            assert [await hello(a) for _ in range(3)] == [ACCEPTED, ACCEPTED, BUSY]  # per id
            assert await hello(b) == ACCEPTED  # 3 unknown: all places but the reserve
            assert await hello(c) == ACCEPTED  # a holds 2, c none: a's oldest gives way
            assert p.metrics["bulk_evicted"] == 1
            assert await hello(d) == BUSY  # a, b, c hold 1 each, none idle 1 s: no room
            # a second later an idle connection may give way to a newcomer (it reconnects)
            await wait_until(lambda: any(r.conn.idle_for() >= 1.0 for r in p.server.conns),
                             10, what="an idle connection")
            assert await hello(d) == ACCEPTED
            assert p.metrics["bulk_evicted"] == 2
            assert await hello(k1) == ACCEPTED  # the reserve
            assert await hello(k2) == ACCEPTED  # all taken: an unknown one gives way
            assert p.metrics["bulk_evicted"] == 3
            peers = [r.peer for r in p.server.conns]
            assert len(peers) == 4 and {k1.peer_id, k2.peer_id} <= set(peers)
        finally:
            for w in held:
                w.transport.abort()


def test_per_address_limits_count_ipv4_addresses_and_ipv6_subnets():
    from swarm_node.node.p2p.bulk.server import address_group

    assert address_group("203.0.113.7") == address_group("::ffff:203.0.113.7") == "203.0.113.7"
    assert address_group("2001:db8::1") == address_group("2001:db8::beef") == "2001:db8::/64"
    assert address_group("2001:db8:0:1::1") != address_group("2001:db8::1")


def test_an_unusable_plane_is_tried_again_later_each_time():
    client = BulkClient(ME, BulkSection(), query=None)
    client.add_kind(KIND, "echoes", 1, 1.0)
    for expected in (60, 120, 240):  # a port never forwarded: a connect timeout per hour
        client.mark_down(SERVER.peer_id, KIND, "unreachable")
        left = client.down[(SERVER.peer_id, KIND)] - time.monotonic()
        assert expected - 10 < left <= expected
    client.set_endpoint(SERVER.peer_id, "127.0.0.1:9")  # a new endpoint: tried at once
    assert client.usable(SERVER.peer_id, KIND)
