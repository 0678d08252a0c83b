"""Bounds a hostile shard client meets on real sockets (loopback): a request whose answer
is never read is cut and frees its upload slot; authenticated data-plane connections are
capped per peer and in total."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest
from swarm_node.node.broadcast.dataplane import DataPlaneServer, TokenIssuer, hello_frame
from swarm_node.node.broadcast.downloader import Downloader
from swarm_node.node.broadcast.server import ShardServer
from swarm_node.node.broadcast.sources import SourceBook
from swarm_node.node.broadcast.store import ShardStore
from swarm_node.node.broadcast.transport import TcpStream, TcpTransport
from swarm_node.node.broadcast.wire import FRAME_HEADER
from swarm_node.node.config import BroadcastSection
from swarm_node.node.p2p.tokens import CHALLENGE_LEN
from swarm_node.protocol.messages import ShardRequest

from .conftest import make_checkpoint, publish, read_dir

SHARD = 2 * 1024 * 1024


async def wait_for(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


def request_frame(acc, shard: int = 0) -> bytes:
    raw = ShardRequest(policy_id=acc.manifest.policy_id, version=acc.manifest.version,
                       shard=shard).encode()
    return FRAME_HEADER.pack(len(raw)) + raw


def non_reader(port: int, first: bytes) -> socket.socket:
    """A client that sends `first` and then never reads (a tiny receive window)."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", port))
    s.sendall(first)
    return s


@pytest.mark.parametrize("zero_copy", [True, False], ids=["sendfile", "chunks"])
async def test_an_upload_nobody_reads_is_cut_and_frees_its_slot(tmp_path, trainer, zero_copy):
    ckpt = make_checkpoint(tmp_path / "ckpt", {"model.safetensors": 2 * SHARD})
    cfg = BroadcastSection(shard_size=SHARD, min_shard_size=4096, chunk_size=256 * 1024,
                           chunk_timeout_s=0.25, request_timeout_s=2.0,
                           max_uploads_total=1)  # one stalled upload would block everyone
    acc = publish(trainer, ckpt, 1, SHARD)
    store = ShardStore(tmp_path / "server")
    store.add_checkpoint(acc, ckpt)
    server = ShardServer(store, cfg)
    server.zero_copy = zero_copy

    async def on_conn(reader, writer):
        # a small send buffer: the answer cannot vanish into the kernel's buffers
        writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 65536)
        await server.serve_connection("tcp:client", TcpStream(reader, writer))

    tcp = await asyncio.start_server(on_conn, "127.0.0.1", 0)
    port = tcp.sockets[0].getsockname()[1]
    stalled = await asyncio.to_thread(non_reader, port, request_frame(acc))
    try:
        await wait_for(lambda: server.metrics["upload_stalled"] == 1, 15, "the cut")
        assert server.active_total == 0 and not server.active
        assert server.metrics["shards_sent"] == 0
        # the slot is free again: an honest client (patient server now) gets everything
        server.cfg = cfg.model_copy(update={"chunk_timeout_s": 30.0})
        client_store = ShardStore(tmp_path / "client")
        entry = client_store.open_version(acc)
        book = SourceBook(per_source=1, max_corrupt=1)
        book.add(f"127.0.0.1:{port}", None)
        path = await Downloader(client_store, entry, TcpTransport(), book, cfg).run()
        assert read_dir(path) == read_dir(ckpt)
        assert server.metrics["error_busy"] == 0
    finally:
        stalled.close()
        tcp.close()
        await tcp.wait_closed()


async def test_authenticated_connections_are_capped_per_peer_and_in_total():
    cfg = BroadcastSection(max_uploads_per_peer=2, max_uploads_total=3)
    issuer = TokenIssuer("12D3KooWServer", 60)
    held: list[asyncio.Event] = []

    async def handle(peer: str, stream) -> None:  # holds the connection like an idle client
        done = asyncio.Event()
        held.append(done)
        await done.wait()
        await stream.close()

    plane = DataPlaneServer(issuer, handle, cfg)
    host, port = await plane.start("127.0.0.1", 0)

    async def connect(peer: str) -> bytes:
        reader, writer = await asyncio.open_connection(host, port)
        conns.append(writer)
        try:
            challenge = await asyncio.wait_for(reader.readexactly(CHALLENGE_LEN), 10)
            writer.write(hello_frame(peer, issuer.issue(peer), challenge))
            return await asyncio.wait_for(reader.read(1), 10)
        except ConnectionResetError:
            return b""

    conns: list[asyncio.StreamWriter] = []
    try:
        per_peer, total = 2 * cfg.max_uploads_per_peer, 2 * cfg.max_uploads_total
        assert [await connect("12D3KooWA") for _ in range(per_peer + 1)] == \
            [b"\x01"] * per_peer + [b""]  # one over the per-peer cap: closed without a byte
        others = [await connect(f"12D3KooWB{i}") for i in range(total - per_peer + 1)]
        assert others == [b"\x01"] * (total - per_peer) + [b""]  # one over the total cap
        assert plane.metrics["refused_peer_conns"] == 1
        assert plane.metrics["refused_conns"] == 1
        for done in held:  # the connections end: their places are free again
            done.set()
        await wait_for(lambda: not plane.conns, 10, "the connections to be released")
        assert await connect("12D3KooWA") == b"\x01"
    finally:
        for w in conns:
            w.transport.abort()
        for done in held:
            done.set()
        plane.close()
