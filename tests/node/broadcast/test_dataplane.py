"""The authenticated TCP data plane (issue 13) against real processes: the default path,
its refusals (no token, another peer's token, a replayed hello, garbage, oversized,
slow-loris) and the automatic libp2p fallback."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from swarm_node.node.broadcast.dataplane import (
    SHARD_TOKEN_PROTOCOL,
    TokenIssuer,
    hello_frame,
    parse_token,
)
from swarm_node.node.broadcast.wire import FRAME_HEADER
from swarm_node.node.config import Config
from swarm_node.node.identity import Identity
from swarm_node.node.p2p.tokens import CHALLENGE_LEN, new_challenge, prove
from swarm_node.protocol.messages import ShardRequest

from .conftest import SHARD, boot, make_checkpoint, read_dir
from .procs import BroadcastProc

pytestmark = pytest.mark.slow


async def stats(p: BroadcastProc) -> dict:
    p.send("stats")
    return await p.event("stats")


async def exchange(endpoint: str, data, timeout: float = 30) -> bytes:
    """Read the server's challenge, send `data` (or `data(challenge)`), return everything
    the server sends after the challenge until it closes (deadline-bound)."""
    host, _, port = endpoint.rpartition(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        async with asyncio.timeout(timeout):
            challenge = await reader.readexactly(CHALLENGE_LEN)
            writer.write(data(challenge) if callable(data) else data)
            writer.write_eof()  # no more requests: the server need not keep the connection
            out = b""
            while chunk := await reader.read(1 << 16):
                out += chunk
        return out
    except (ConnectionError, asyncio.IncompleteReadError):
        return b""
    finally:
        writer.close()


def request_frame(policy: str, version: int = 1, shard: int = 0) -> bytes:
    body = ShardRequest(policy_id=policy, version=version, shard=shard).encode()
    return FRAME_HEADER.pack(len(body)) + body


def test_tokens_are_bound_to_the_peer_and_expire():
    a, b = Identity.generate().peer_id, Identity.generate().peer_id
    issuer = TokenIssuer("server", ttl_s=60)
    c = new_challenge()
    expiry, mac = parse_token(issuer.issue(a))
    assert issuer.check(a, expiry, prove(mac, c), c)
    assert not issuer.check(b, expiry, prove(mac, c), c)  # another peer's token
    assert not issuer.check(a, expiry + 1, prove(mac, c), c)  # a longer life is not for the taking
    other_node = TokenIssuer("server", ttl_s=60)  # another node's secret
    assert not other_node.check(a, expiry, prove(mac, c), c)
    assert not issuer.check(a, expiry, prove(mac, c), new_challenge())  # one proof, one challenge
    assert not issuer.check(a, expiry, mac, c)  # the token itself is no proof
    old = TokenIssuer("server", ttl_s=-1, secret=issuer.secret)
    expiry, mac = parse_token(old.issue(a))
    assert not issuer.check(a, expiry, prove(mac, c), c)  # expired


async def test_default_broadcast_uses_the_authenticated_data_plane(tmp_path, procs):
    ckpt = make_checkpoint(tmp_path / "ckpt", {"model.safetensors": 2 * 2**20 + 5})
    trainer = procs("trainer", "trainer", tmp_path / "trainer")
    await trainer.ready()
    f = procs("f", "inference", tmp_path / "f", "--follow", trainer.peer_id, *boot(trainer),
              log_level="INFO")
    await f.ready()
    trainer.send(f"publish {ckpt} 1")
    await trainer.event("published")
    done = await f.event("complete", timeout=90)
    assert read_dir(Path(done["path"])) == read_dir(ckpt)
    # The trainer advertises its endpoint before it gossips the manifest, but the two
    # topics' messages may be handled in either order: requests opened before the advert
    # arrived (at most the 4 per source) go over libp2p, everything after over TCP.
    assert done["streams"]["tcp"] > 0 and done["streams"]["libp2p"] <= 4
    assert done["streams"]["tcp_reused"] > 0  # several shards per authenticated connection
    t = await stats(trainer)
    assert t["dataplane"]["authenticated"] == done["streams"]["tcp"]
    assert t["server"]["shards_sendfile"] > 0  # zero-copy
    assert f"shards from {trainer.peer_id[-8:]} over the TCP data plane" in f.stderr_tail(20000)


async def test_data_plane_refuses_what_is_not_authenticated(tmp_path, procs):
    ckpt = make_checkpoint(tmp_path / "ckpt", {"model.safetensors": 300_000})
    trainer = procs("trainer", "trainer", tmp_path / "trainer", "--tcp-auth-timeout", "1")
    await trainer.ready()
    trainer.send(f"publish {ckpt} 1")
    await trainer.event("published")
    endpoint = (await stats(trainer))["endpoint"]
    policy = trainer.peer_id
    # a plain shard request, garbage, an oversized hello: closed, not one byte back
    assert await exchange(endpoint, request_frame(policy)) == b""
    assert await exchange(endpoint, b"\x00\x00\x00\x10" + b"\xc1" * 16) == b""
    assert await exchange(endpoint, FRAME_HEADER.pack(1 << 31) + b"x" * 1000) == b""
    # a real peer gets a token over libp2p (Noise), then another key tries to use it
    from swarm_node.node.p2p import P2PNode

    cfg = Config()
    cfg.node.listen = ["/ip4/127.0.0.1/tcp/0"]
    me = P2PNode(Identity.generate(), cfg)
    await me.start(bootstrap=trainer.addrs)
    try:
        token = await me.request(policy, SHARD_TOKEN_PROTOCOL, b"", timeout=10)
    finally:
        await me.close()
    thief = Identity.generate().peer_id
    assert await exchange(endpoint, lambda c: hello_frame(thief, token, c)
                          + request_frame(policy)) == b""
    seen = []  # what someone on the path sees of a good connection: challenge and hello

    def answer(c: bytes) -> bytes:
        seen.append(hello_frame(me.peer_id, token, c))
        return seen[-1] + request_frame(policy)
    got = await exchange(endpoint, answer)
    assert got[:1] == b"\x01" and len(got) > SHARD  # ack, header, the whole shard
    # replayed on a new connection, that hello opens nothing: the challenge is new
    assert await exchange(endpoint, seen[0] + request_frame(policy)) == b""
    # slow-loris: connections that never authenticate are closed; beyond the pending cap
    # they are refused at accept (bounded time and memory per connection)
    host, _, port = endpoint.rpartition(":")
    conns = [await asyncio.open_connection(host, int(port)) for _ in range(80)]
    deadline = time.monotonic() + 60
    try:
        for reader, _ in conns:
            async with asyncio.timeout(max(1.0, deadline - time.monotonic())):
                try:  # at most the challenge, then closed
                    assert len(await reader.read(1 << 10)) <= CHALLENGE_LEN
                    assert await reader.read(1 << 10) == b""
                except ConnectionError:
                    pass
    finally:
        for _, w in conns:
            w.close()
    dp = (await stats(trainer))["dataplane"]
    assert dp["auth_timeout"] >= 1 and dp["refused_pending"] >= 1
    assert dp["unauthenticated"] >= 5 and dp["authenticated"] == 1
    assert trainer.proc.poll() is None


async def test_unreachable_data_plane_falls_back_to_libp2p(tmp_path, procs):
    ckpt = make_checkpoint(tmp_path / "ckpt", {"model.safetensors": 700_000})
    # the advert names a port nobody listens on (a NAT or a firewall in real life)
    trainer = procs("trainer", "trainer", tmp_path / "trainer", "--tcp-advertise",
                    "127.0.0.1:9")
    await trainer.ready()
    f = procs("f", "inference", tmp_path / "f", "--follow", trainer.peer_id, *boot(trainer),
              log_level="INFO")
    await f.ready()
    trainer.send(f"publish {ckpt} 1")
    await trainer.event("published")
    done = await f.event("complete", timeout=90)
    assert read_dir(Path(done["path"])) == read_dir(ckpt)
    assert done["streams"]["libp2p"] > 0
    log = f.stderr_tail(20000)
    assert f"shards from {trainer.peer_id[-8:]} over libp2p streams (data plane 127.0.0.1:9" \
        in log
    assert log.count(f"shards from {trainer.peer_id[-8:]} over") == 1  # one line per source
