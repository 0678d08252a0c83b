"""Bounds a hostile shard client meets on real sockets (loopback): a request whose answer
is never read is cut and frees its upload slot, over plain TCP and over the bulk plane
(whose uploads run in a worker thread: the cut must end it). The bulk plane's connection
limits are tested in tests/node/p2p/test_bulk_plane.py."""

from __future__ import annotations

import asyncio
import socket
from types import SimpleNamespace

import pytest
from swarm_node.node.broadcast.downloader import Downloader
from swarm_node.node.broadcast.server import ShardServer
from swarm_node.node.broadcast.sources import SourceBook
from swarm_node.node.broadcast.store import ShardStore
from swarm_node.node.broadcast.transport import RoutingTransport, TcpStream, TcpTransport
from swarm_node.node.broadcast.wire import FRAME_HEADER
from swarm_node.node.config import BroadcastSection, BulkSection
from swarm_node.node.identity import Identity
from swarm_node.node.p2p.bulk import BulkClient, BulkServer
from swarm_node.node.p2p.bulk.cert import client_context, server_context
from swarm_node.node.p2p.bulk.hello import ACCEPTED, CHALLENGE_LEN, hello_frame
from swarm_node.node.p2p.metrics import P2PMetrics
from swarm_node.protocol.messages import ShardRequest

from tests.waiting import async_wait_until

from .conftest import make_checkpoint, publish, read_dir

SHARD = 2 * 1024 * 1024


def request_frame(acc, shard: int = 0) -> bytes:
    raw = ShardRequest(policy_id=acc.manifest.policy_id, version=acc.manifest.version,
                       shard=shard).encode()
    return FRAME_HEADER.pack(len(raw)) + raw


SERVER, ME = Identity.generate(), Identity.generate()


def non_reader(port: int, first: bytes, bulk: bool) -> socket.socket:
    """A client that sends `first` (after the TLS handshake and hello, on the bulk plane)
    and then never reads (a tiny receive window)."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", port))
    if bulk:
        s = client_context().wrap_socket(s)
        challenge = b""
        while len(challenge) < CHALLENGE_LEN:
            challenge += s.recv(CHALLENGE_LEN - len(challenge))
        s.sendall(hello_frame(ME, SERVER.peer_id, "shard", challenge))
        assert s.recv(1) == ACCEPTED
    s.sendall(first)
    return s


async def serve_on(path: str, server: ShardServer):
    """(port, honest client transport, source name, close) of `server` on `path`."""
    if path == "tcp":
        async def on_conn(reader, writer):
            # a small send buffer: the answer cannot vanish into the kernel's buffers
            writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF,
                                                       65536)
            await server.serve_connection("tcp:client", TcpStream(reader, writer))

        tcp = await asyncio.start_server(on_conn, "127.0.0.1", 0)
        port = tcp.sockets[0].getsockname()[1]
        return port, TcpTransport(), f"127.0.0.1:{port}", tcp.close
    plane = BulkServer(SERVER.peer_id, server_context(SERVER), BulkSection(), P2PMetrics())
    plane.register("shard", server.serve_connection)
    _, port = await plane.start("127.0.0.1", 0)
    rt = RoutingTransport(None, bulk=SimpleNamespace(
        client=BulkClient(Identity.generate(), BulkSection(), query=None)))
    rt.set_endpoint(SERVER.peer_id, f"127.0.0.1:{port}")
    return port, rt, SERVER.peer_id, plane.close


@pytest.mark.parametrize("path", ["tcp", "bulk"])
@pytest.mark.parametrize("zero_copy", [True, False], ids=["sendfile", "chunks"])
async def test_an_upload_nobody_reads_is_cut_and_frees_its_slot(tmp_path, trainer, zero_copy,
                                                                path):
    # on the bulk plane the kernel's send buffer (up to 4 MiB) is not made small: a shard
    # larger than it cannot vanish into it
    shard = SHARD if path == "tcp" else 8 * SHARD
    ckpt = make_checkpoint(tmp_path / "ckpt", {"model.safetensors": 2 * shard})
    cfg = BroadcastSection(shard_size=shard, min_shard_size=4096, chunk_size=1024 * 1024,
                           chunk_timeout_s=0.25, request_timeout_s=2.0,
                           max_uploads_total=1)  # one stalled upload would block everyone
    acc = publish(trainer, ckpt, 1, shard)
    store = ShardStore(tmp_path / "server")
    store.add_checkpoint(acc, ckpt)
    server = ShardServer(store, cfg)
    server.zero_copy = zero_copy
    port, transport, source, close = await serve_on(path, server)
    stalled = await asyncio.to_thread(non_reader, port, request_frame(acc), path == "bulk")
    try:
        await async_wait_until(lambda: server.metrics["upload_stalled"] == 1, 15, "the cut")
        assert server.active_total == 0 and not server.active
        assert server.metrics["shards_sent"] == 0
        # the slot is free again: an honest client (patient server now) gets everything
        server.cfg = cfg.model_copy(update={"chunk_timeout_s": 30.0})
        client_store = ShardStore(tmp_path / "client")
        entry = client_store.open_version(acc)
        book = SourceBook(per_source=1, max_corrupt=1)
        book.add(source, None)
        got = await Downloader(client_store, entry, transport, book, cfg).run()
        assert read_dir(got) == read_dir(ckpt)
        assert server.metrics["error_busy"] == 0
    finally:
        stalled.close()
        result = close()
        if asyncio.iscoroutine(result):
            await result


async def test_a_shard_goes_to_two_askers_at_once_the_next_take_it_from_them(tmp_path,
                                                                              trainer):
    """A holder (not the trainer) uploads one shard to at most `max_uploads_per_shard` (2)
    askers at once and answers `seeded` to a third on a stream kept open (that asker takes
    the shard from the two, or asks again after its hold-back); its other shards are
    served, and once an upload ends the shard is served again. Before, the holder of a
    shard few others held uploaded it to every asker at once, each copy slower."""
    from swarm_node.node.broadcast.errors import ShardFetchError
    from swarm_node.node.broadcast.server import RateLimiter
    from swarm_node.node.broadcast.transport import serve_tcp
    from swarm_node.node.broadcast.wire import fetch

    shard = 1024 * 1024
    ckpt = make_checkpoint(tmp_path / "ckpt", {"model.safetensors": 2 * shard})
    cfg = BroadcastSection(shard_size=shard, min_shard_size=4096, chunk_size=16 * 1024)
    acc = publish(trainer, ckpt, 1, shard)
    store = ShardStore(tmp_path / "holder")
    store.add_checkpoint(acc, ckpt)
    server = ShardServer(store, cfg)
    server.limiter = RateLimiter(256 * 1024)  # uploads that last while the test asks
    tcp = await serve_tcp(server.serve_connection)
    source = f"127.0.0.1:{tcp.sockets[0].getsockname()[1]}"
    transport = TcpTransport()

    def ask(i: int):
        req = ShardRequest(policy_id=acc.manifest.policy_id, version=1, shard=i)
        return fetch(transport, source, req, expected_len=shard, request_timeout=5,
                     chunk_timeout=30, chunk_size=cfg.chunk_size)
    uploads = [ask(0), ask(0)]
    try:
        for u in uploads:
            assert await anext(u)  # both under way
        with pytest.raises(ShardFetchError) as third:
            await anext(ask(0))
        assert third.value.reason == "seeded"
        assert server.metrics["spread_seeded"] == 1 and server.metrics["error_busy"] == 0
        other = ask(1)
        assert await anext(other)  # another shard of the same holder: served
        await other.aclose()
        await uploads.pop().aclose()  # one of the two ends: shard 0 is served again
        await async_wait_until(lambda: server.active_shards[(trainer.peer_id, 1, 0)] < 2,
                               15, "the ended upload's slot")
        uploads.append(ask(0))
        assert await anext(uploads[-1])
    finally:
        for u in uploads:
            await u.aclose()
        tcp.close()
