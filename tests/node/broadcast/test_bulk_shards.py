"""Shards over the bulk plane against real processes: the default path, what a real process
refuses, the libp2p fallback for an unreachable plane, and an on-path attacker who changes
shard bytes (the download completes; the honest source is not charged)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from swarm_node.node.broadcast.wire import FRAME_HEADER
from swarm_node.node.identity import Identity
from swarm_node.node.p2p.bulk.cert import client_context
from swarm_node.node.p2p.bulk.hello import CHALLENGE_LEN, HEADER, hello_frame
from swarm_node.node.testing.onpath import Proxy
from swarm_node.protocol.messages import ShardRequest

from .conftest import SHARD, boot, make_checkpoint, read_dir
from .procs import BroadcastProc

pytestmark = pytest.mark.slow


async def stats(p: BroadcastProc) -> dict:
    p.send("stats")
    return await p.event("stats")


def request_frame(policy: str, version: int = 1, shard: int = 0) -> bytes:
    body = ShardRequest(policy_id=policy, version=version, shard=shard).encode()
    return FRAME_HEADER.pack(len(body)) + body


async def plain(port: int, data: bytes) -> bytes:
    """Plain TCP: send `data`, return what comes back before the plane closes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        return await asyncio.wait_for(reader.read(1 << 16), 30)
    except ConnectionError:
        return b""
    finally:
        writer.transport.abort()


async def tls(port: int, hello) -> bytes:
    """TLS: send `hello(challenge)` and a shard request; what comes back before closing."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=client_context(),
                                                   server_hostname="")
    try:
        writer.write(hello(await reader.readexactly(CHALLENGE_LEN)))
        out = b""
        while part := await asyncio.wait_for(reader.read(1 << 16), 30):
            out += part
        return out
    except ConnectionError:
        return b""
    finally:
        writer.transport.abort()


async def test_default_broadcast_uses_the_bulk_plane(tmp_path, procs):
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
    # the follower finds the trainer's plane from its advert, or asks over libp2p: every
    # shard goes over it (no libp2p stream), several per connection
    assert done["streams"]["bulk"] > 0 and done["streams"]["libp2p"] == 0
    assert done["streams"]["bulk_reused"] > 0
    t = await stats(trainer)
    assert t["bulk"]["bulk_authenticated"] >= done["streams"]["bulk"]
    assert t["server"]["shards_sendfile"] > 0  # shards leave the event loop
    assert f"shards from {trainer.peer_id[-8:]} over the bulk plane" in f.stderr_tail(20000)


async def test_a_real_process_refuses_what_is_not_authenticated(tmp_path, procs):
    ckpt = make_checkpoint(tmp_path / "ckpt", {"model.safetensors": 300_000})
    trainer = procs("trainer", "trainer", tmp_path / "trainer", "--bulk-handshake-timeout",
                    "1")
    port = (await trainer.ready())["bulk"][1]
    trainer.send(f"publish {ckpt} 1")
    await trainer.event("published")
    policy = trainer.peer_id
    # a plain shard request, garbage, an oversized frame: no TLS, no byte of a shard
    for data in (request_frame(policy), b"\x00\x00\x00\x10" + b"\xc1" * 16,
                 FRAME_HEADER.pack(1 << 31) + b"x" * 1000):
        assert SHARD.to_bytes(4, "big") not in await plain(port, data)
    me = Identity.generate()
    seen = []

    def good(c: bytes) -> bytes:  # what only the trainer sees of a good connection
        seen.append(hello_frame(me, policy, "shard", c))
        return seen[-1] + request_frame(policy)

    assert len(await tls(port, good)) > SHARD  # ack, header, the whole shard
    for hello in (lambda c: seen[0] + request_frame(policy),  # replayed: a new challenge
                  lambda c: hello_frame(me, me.peer_id, "shard", c) + request_frame(policy),
                  lambda c: HEADER.pack(400) + b"\x00" * 400 + request_frame(policy)):
        assert await tls(port, hello) == b""
    # silent connections are closed at the handshake timeout; the process is unharmed
    conns = [await asyncio.open_connection("127.0.0.1", port) for _ in range(80)]
    try:
        for reader, _ in conns:
            try:
                assert await asyncio.wait_for(reader.read(1 << 10), 30) == b""
            except ConnectionError:
                pass
    finally:
        for _, w in conns:
            w.transport.abort()
    b = (await stats(trainer))["bulk"]
    assert b["bulk_authenticated"] == 1 and b["bulk_bad_hello"] == 3
    assert b["bulk_handshake_timeout"] + b.get("bulk_pending_evicted", 0) >= 80
    assert trainer.proc.poll() is None


async def test_an_unreachable_plane_falls_back_to_libp2p(tmp_path, procs):
    ckpt = make_checkpoint(tmp_path / "ckpt", {"model.safetensors": 700_000})
    # the advert names a port nobody listens on (a NAT or a firewall in real life)
    trainer = procs("trainer", "trainer", tmp_path / "trainer", "--bulk-advertise",
                    "127.0.0.1:9")
    await trainer.ready()
    f = procs("f", "inference", tmp_path / "f", "--follow", trainer.peer_id, *boot(trainer),
              log_level="INFO")
    await f.ready()
    trainer.send(f"publish {ckpt} 1")
    await trainer.event("published")
    done = await f.event("complete", timeout=90)
    assert read_dir(Path(done["path"])) == read_dir(ckpt)
    assert done["streams"]["libp2p"] > 0 and done["streams"]["bulk"] == 0
    log = f.stderr_tail(20000)
    assert f"shards from {trainer.peer_id[-8:]} over libp2p streams (bulk plane 127.0.0.1:9" \
        in log
    assert log.count(f"shards from {trainer.peer_id[-8:]} over") == 1  # one line per source


async def test_shard_bytes_changed_on_the_path_cost_the_honest_source_nothing(tmp_path,
                                                                            procs):
    ckpt = make_checkpoint(tmp_path / "ckpt", {"model.safetensors": 700_000})
    proxy = Proxy(flip_after=SHARD // 2)  # inside the first shard on each connection
    port = await proxy.start()
    trainer = procs("trainer", "trainer", tmp_path / "trainer", "--bulk-advertise",
                    f"127.0.0.1:{port}")
    proxy.target = (await trainer.ready())["bulk"][1]
    f = procs("f", "inference", tmp_path / "f", "--follow", trainer.peer_id, *boot(trainer),
              log_level="INFO")
    await f.ready()
    try:
        trainer.send(f"publish {ckpt} 1")
        await trainer.event("published")
        done = await f.event("complete", timeout=90)
    finally:
        proxy.close()
    assert proxy.flipped >= 1
    assert read_dir(Path(done["path"])) == read_dir(ckpt)
    # the changed record failed TLS's check: a broken transfer, not a corrupt shard
    assert done["metrics"].get("shards_corrupt", 0) == 0
    source = done["sources"][trainer.peer_id]
    assert source["corrupt"] == 0 and not source["dropped"]
    assert done["p2p"].get("peers_cut", 0) == 0 and done["streams"]["libp2p"] > 0
    assert f"shards from {trainer.peer_id[-8:]} over libp2p streams (TLS integrity failure" \
        in f.stderr_tail(20000)
