"""Server + downloader through the real shard protocol, in memory and over TCP."""

from __future__ import annotations

import asyncio

import pytest
from swarm_node.node.broadcast.downloader import Downloader
from swarm_node.node.broadcast.errors import DownloadFailed, ShardFetchError
from swarm_node.node.broadcast.server import ShardServer
from swarm_node.node.broadcast.sources import SourceBook
from swarm_node.node.broadcast.store import ShardStore
from swarm_node.node.broadcast.transport import MemoryTransport, TcpTransport, serve_tcp
from swarm_node.node.broadcast.wire import fetch, read_frame, write_frame
from swarm_node.node.identity import Identity
from swarm_node.protocol.messages import ShardRequest, ShardResponseHeader

from tests.waiting import async_wait_until

from .conftest import publish, read_dir


class CorruptStore(ShardStore):
    """Serves a flipped byte in the listed shards (a hostile or broken relay)."""

    def __init__(self, root, bad: set[int]):
        super().__init__(root)
        self.bad = bad

    def read_shard(self, entry, index, offset=0, length=0, chunk=1 << 20):
        it = super().read_shard(entry, index, offset, length, chunk)
        if index not in self.bad:
            return it

        def flipped():
            first = True
            for data in it:
                yield bytes([data[0] ^ 1]) + data[1:] if first else data
                first = False
        return flipped()


class DyingServer(ShardServer):
    """Sends the header and half a shard, then drops the stream (a relay killed mid-way)."""

    async def _handle(self, peer, stream):
        raw = await read_frame(stream)
        req = ShardRequest.decode(raw)
        entry = self.store.get(req.policy_id, req.version)
        size = entry.shard_len(req.shard)
        await write_frame(stream, ShardResponseHeader(ok=True, length=size).encode())
        data = b"".join(self.store.read_shard(entry, req.shard))
        await stream.write(data[: size // 2])


def serving(tmp_path, name, trainer, ckpt, cfg, store_cls=ShardStore, server_cls=ShardServer,
            **kw):
    acc = publish(trainer, ckpt, 1, cfg.shard_size)
    store = store_cls(tmp_path / name, **kw)
    store.add_checkpoint(acc, ckpt)
    return acc, server_cls(store, cfg)


def client(tmp_path, acc, cfg, name="client"):
    store = ShardStore(tmp_path / name)
    entry = store.open_version(acc)
    book = SourceBook(per_source=cfg.per_source_downloads, max_corrupt=cfg.max_corrupt_per_source)
    return store, entry, book


async def test_download_from_two_sources_is_byte_identical(tmp_path, trainer, ckpt, cfg):
    acc, s1 = serving(tmp_path, "a", trainer, ckpt, cfg)
    _, s2 = serving(tmp_path, "b", trainer, ckpt, cfg)
    t = MemoryTransport()
    t.register("a", s1.handle)
    t.register("b", s2.handle)
    store, entry, book = client(tmp_path, acc, cfg)
    book.add("a", None)
    book.add("b", None)
    d = Downloader(store, entry, t, book, cfg)
    path = await d.run()
    assert read_dir(path) == read_dir(ckpt)
    assert d.metrics["bytes_fetched"] == acc.manifest.total_size
    assert book.sources["a"].shards_ok > 0 and book.sources["b"].shards_ok > 0


async def test_corrupt_source_costs_one_shard_and_is_dropped(tmp_path, trainer, ckpt, cfg):
    acc, good = serving(tmp_path, "good", trainer, ckpt, cfg)
    _, evil = serving(tmp_path, "evil", trainer, ckpt, cfg, store_cls=CorruptStore, bad={2})
    t = MemoryTransport()
    t.register("good", good.handle)
    t.register("evil", evil.handle)
    store, entry, book = client(tmp_path, acc, cfg)
    book.add("evil", None)
    # one transfer at a time: the client hits shard 2 from "evil" first, the only source
    # until it misbehaves
    d = Downloader(store, entry, t, book, cfg.model_copy(update={"parallel_downloads": 1}))
    d.pending = [2] + [i for i in d.pending if i != 2]
    task = asyncio.create_task(d.run())
    await async_wait_until(lambda: book.sources["evil"].dropped, 20, "the corrupt source dropped")
    book.add("good", None)
    d.sources_changed()
    path = await task
    assert read_dir(path) == read_dir(ckpt)
    assert d.metrics["shards_corrupt"] == 1
    assert d.metrics["bytes_corrupt"] == entry.shard_len(2)
    assert d.metrics["bytes_fetched"] == acc.manifest.total_size + entry.shard_len(2)
    assert book.sources["evil"].corrupt == 1 and book.sources["evil"].dropped


async def test_source_dying_mid_shard_falls_back(tmp_path, trainer, ckpt, cfg):
    acc, good = serving(tmp_path, "good", trainer, ckpt, cfg)
    _, dying = serving(tmp_path, "dying", trainer, ckpt, cfg, server_cls=DyingServer)
    t = MemoryTransport()
    t.register("good", good.handle)
    t.register("dying", dying.handle)
    store, entry, book = client(tmp_path, acc, cfg)
    book.add("dying", None)
    book.add("good", None)
    d = Downloader(store, entry, t, book, cfg)
    path = await d.run()
    assert read_dir(path) == read_dir(ckpt)
    assert d.metrics["fail_short_read"] >= 1
    assert book.sources["dying"].shards_ok == 0 and book.sources["dying"].failures >= 1


async def test_resume_fetches_only_missing_shards(tmp_path, trainer, ckpt, cfg):
    acc, good = serving(tmp_path, "good", trainer, ckpt, cfg)
    t = MemoryTransport()
    t.register("good", good.handle)
    store, entry, book = client(tmp_path, acc, cfg)
    for i in (0, 1, 3):
        w = store.begin_shard(entry, i)
        for data in good.store.read_shard(good.store.get(*entry.key), i):
            w.write(data)
        w.commit()
    restarted = ShardStore(tmp_path / "client")
    (entry,) = restarted.load()
    book.add("good", None)
    d = Downloader(restarted, entry, t, book, cfg)
    path = await d.run()
    assert read_dir(path) == read_dir(ckpt)
    resumed = sum(entry.shard_len(i) for i in (0, 1, 3))
    assert d.metrics["shards_resumed"] == 3
    assert d.metrics["bytes_fetched"] == acc.manifest.total_size - resumed


async def test_no_source_stalls_with_error(tmp_path, trainer, ckpt, cfg):
    acc, _ = serving(tmp_path, "good", trainer, ckpt, cfg)
    cfg = cfg.model_copy(update={"stall_timeout_s": 0.3})
    store, entry, book = client(tmp_path, acc, cfg)
    with pytest.raises(DownloadFailed) as e:
        await Downloader(store, entry, MemoryTransport(), book, cfg).run()
    assert e.value.reason == "stalled"


async def fetch_all(t, peer, req, cfg, expected_len, timeout: float = 1.0):
    out = b""
    async for data in fetch(t, peer, req, expected_len=expected_len, request_timeout=timeout,
                            chunk_timeout=timeout, chunk_size=cfg.chunk_size):
        out += data
    return out


async def test_server_errors_are_answers_not_hangs(tmp_path, trainer, ckpt, cfg):
    acc, server = serving(tmp_path, "good", trainer, ckpt, cfg)
    t = MemoryTransport()
    t.register("s", server.handle)
    m = acc.manifest
    cases = [(ShardRequest(policy_id=m.policy_id, version=m.version, shard=m.num_shards),
              "unknown_shard"),
             (ShardRequest(policy_id=m.policy_id, version=m.version + 1, shard=0),
              "unknown_shard"),
             (ShardRequest(policy_id=m.policy_id, version=m.version, shard=0,
                           offset=m.shard_size + 1), "bad_range")]
    for req, reason in cases:
        with pytest.raises(ShardFetchError) as e:
            await fetch_all(t, "s", req, cfg, 1)
        assert e.value.reason == reason
    # a range request returns exactly that range
    blob = b"".join((ckpt / f.name).read_bytes() for f in m.files)
    req = ShardRequest(policy_id=m.policy_id, version=m.version, shard=1, offset=10, length=100)
    assert await fetch_all(t, "s", req, cfg, 100) == blob[m.shard_size + 10: m.shard_size + 110]
    # garbage instead of a request
    stream = await t.open("s")
    await write_frame(stream, b"\x93garbage")
    hdr = ShardResponseHeader.decode(await read_frame(stream))
    assert not hdr.ok and hdr.error == "bad_request"
    # an oversized frame header
    stream = await t.open("s")
    await stream.write(b"\xff\xff\xff\xff")
    hdr = ShardResponseHeader.decode(await read_frame(stream))
    assert hdr.error == "bad_request"
    assert server.metrics["error_unknown_shard"] == 2 and server.metrics["error_bad_request"] == 2


async def test_silent_client_is_timed_out(tmp_path, trainer, ckpt, cfg):
    cfg = cfg.model_copy(update={"request_timeout_s": 0.2})
    _, server = serving(tmp_path, "good", trainer, ckpt, cfg)
    t = MemoryTransport()
    t.register("s", server.handle)
    stream = await t.open("s")
    (task,) = t.tasks
    await asyncio.wait_for(task, 5)  # the handler returns on its own
    hdr = ShardResponseHeader.decode(await read_frame(stream))
    assert hdr.error == "bad_request"


async def test_concurrency_limit_answers_busy(tmp_path, trainer, ckpt, cfg):
    cfg = cfg.model_copy(update={"max_uploads_per_peer": 1})
    acc, server = serving(tmp_path, "good", trainer, ckpt, cfg)
    m = acc.manifest
    t = MemoryTransport()
    t.register("s", server.handle)
    req = ShardRequest(policy_id=m.policy_id, version=m.version, shard=0)
    slow = await t.open("s")  # first upload, not read: backpressure keeps it active
    await write_frame(slow, req.encode())
    await async_wait_until(lambda: server.active_total, 10, "the first upload")
    with pytest.raises(ShardFetchError) as e:
        await fetch_all(t, "s", req, cfg, m.shard_size)
    assert e.value.reason == "busy"
    await slow.close()


async def test_tcp_transport_end_to_end(tmp_path, trainer, ckpt, cfg):
    acc, server = serving(tmp_path, "good", trainer, ckpt, cfg)
    tcp = await serve_tcp(server.handle, "127.0.0.1", 0)
    port = tcp.sockets[0].getsockname()[1]
    try:
        store, entry, book = client(tmp_path, acc, cfg)
        book.add(f"127.0.0.1:{port}", None)
        path = await Downloader(store, entry, TcpTransport(), book, cfg).run()
        assert read_dir(path) == read_dir(ckpt)
    finally:
        tcp.close()
        await tcp.wait_closed()


async def test_bulk_plane_connections_carry_several_requests(tmp_path, trainer, ckpt, cfg):
    """One authenticated bulk connection serves shard after shard (no new connection,
    handshake and hello per shard); an idle one is closed quietly by the server after
    request_timeout_s, and the client notices and opens a fresh one; a server that
    answers one request per connection still works with a reusing client."""
    from types import SimpleNamespace

    from swarm_node.node.broadcast.transport import RoutingTransport
    from swarm_node.node.config import BulkSection
    from swarm_node.node.p2p.bulk import BulkClient, BulkServer
    from swarm_node.node.p2p.bulk.cert import server_context
    from swarm_node.node.p2p.metrics import P2PMetrics

    # Reuse is what is counted here: no deadline of the download (the server's idle bound
    # included) may be short enough to pass on a busy machine and open another connection.
    # The idle close has its own step at the end, with a short bound.
    cfg = cfg.model_copy(update={"request_timeout_s": 30.0, "chunk_timeout_s": 30.0})
    acc, server = serving(tmp_path, "srv", trainer, ckpt, cfg)
    srv, me = Identity.generate(), Identity.generate()
    for handler, name in ((server.serve_connection, "keep"), (server.handle, "one")):
        metrics = P2PMetrics()
        plane = BulkServer(srv.peer_id, server_context(srv), BulkSection(), metrics)
        plane.register("shard", handler)
        _, port = await plane.start("127.0.0.1", 0)
        rt = RoutingTransport(None, bulk=SimpleNamespace(
            client=BulkClient(me, BulkSection(), query=None)))
        try:
            rt.set_endpoint(srv.peer_id, f"127.0.0.1:{port}")
            store, entry, book = client(tmp_path, acc, cfg, name=f"client-{name}")
            book.add(srv.peer_id, None)
            path = await Downloader(store, entry, rt, book, cfg).run()
            assert read_dir(path) == read_dir(ckpt)
            n = acc.manifest.num_shards
            assert rt.opened["libp2p"] == 0
            assert metrics["bulk_authenticated"] == rt.opened["bulk"]
            if name == "one":
                continue
            assert rt.opened["bulk"] <= cfg.parallel_downloads < n
            assert rt.opened["bulk"] + rt.opened["bulk_reused"] == n
            # a connection idle past the server's bound (0.3 s now) is closed quietly and
            # seen as dead at reuse: the next request opens a fresh one
            rt.close()  # the download's connections (idle under the 30 s bound)
            server.cfg = cfg.model_copy(update={"request_timeout_s": 0.3})
            req = ShardRequest(policy_id=trainer.peer_id, version=1, shard=0)
            shard = b"".join(store.read_shard(entry, 0))
            before = rt.opened["bulk"]
            assert await fetch_all(rt, srv.peer_id, req, cfg, len(shard), timeout=30) == shard
            (pooled,) = rt.bulk.kinds["shard"].pool[srv.peer_id]
            await async_wait_until(lambda c=pooled: not c.alive(), 10,
                                   "the server to close its idle connection")
            assert await fetch_all(rt, srv.peer_id, req, cfg, len(shard), timeout=30) == shard
            assert rt.opened["bulk"] == before + 2
        finally:
            rt.close()
            await plane.close()


async def test_pooled_libp2p_streams_against_both_kinds_of_server(tmp_path, trainer, ckpt, cfg):
    """Shard streams are pooled per source: a server that keeps a stream serves shard after
    shard on it; one that answers one request per stream (or ended an idle stream) shows as
    a short read on a reused stream, which is retried once on a fresh stream and costs the
    source nothing."""
    from types import SimpleNamespace

    from swarm_node.node.broadcast.transport import RoutingTransport

    acc, server = serving(tmp_path, "srv", trainer, ckpt, cfg)
    for handler, name in ((server.serve_connection, "keep"), (server.handle, "one")):
        t = MemoryTransport()
        t.register("srv", handler)
        rt = RoutingTransport(SimpleNamespace(open=t.open))  # no bulk plane
        store, entry, book = client(tmp_path, acc, cfg, name=f"client-{name}")
        book.add("srv", None)
        path = await Downloader(store, entry, rt, book, cfg).run()
        assert read_dir(path) == read_dir(ckpt)
        n = acc.manifest.num_shards
        assert book.sources["srv"].failures == 0 and book.sources["srv"].shards_ok == n
        assert rt.opened["libp2p_reused"] > 0
        if name == "keep":
            assert rt.opened["libp2p"] <= cfg.per_source_downloads < n
        else:  # every reuse found the stream ended and opened a fresh one
            assert rt.opened["libp2p"] == n
        rt.close()
