"""The bulk paths of AsyncStream over real libp2p hosts on loopback: `sendfile` (a file
range sent from the trio thread) and `receive_into` (a body handed to a blocking sink in
worker threads, one bridge crossing per transfer)."""

from __future__ import annotations

import asyncio
import os
import threading

import pytest
from swarm_node.node.p2p import StreamError

from .conftest import wait_until

PROTO = "/t/bulk/1"


async def pair(make_node, handler):
    server = await make_node(discovery=False)
    client = await make_node(bootstrap=server.listen_addrs, discovery=False)
    await server.set_stream_handler(PROTO, handler, max_inbound=1 << 20)
    return client, await client.open_stream(server.peer_id, PROTO)


async def test_file_ranges_and_writes_arrive_whole_in_any_chunking(make_node, tmp_path):
    blob = os.urandom(3 * 1024 * 1024 + 4321)
    path = tmp_path / "blob"
    path.write_bytes(blob)
    # file ranges (odd offsets, sizes around the 1 MiB read and the ~1 MiB frame) and
    # plain writes of every buffer kind, interleaved
    plan = [(0, 1), (5, 1 << 20), (7, (1 << 20) + 13), (100_000, 65519 * 16 - 12),
            (len(blob) - 2_000_000, 2_000_000)]
    extras = [bytearray(b"ab" * 70_000), memoryview(blob)[3:200_003], b"z"]

    async def handler(peer, stream):
        for (off, n), extra in zip(plan, extras + [b""] * len(plan)):
            await stream.sendfile(path, off, n)
            if extra:
                await stream.write(extra)
        await stream.close()

    expected = b"".join(blob[off:off + n] + bytes(extra) for (off, n), extra in
                        zip(plan, extras + [b""] * len(plan)))
    _, stream = await pair(make_node, handler)
    for chunk_size in (1000, 65536, 1 << 20):  # sizes the sink sees: at most chunk_size
        got: list[bytes] = []
        threads = set()

        def sink(data, got=got, chunk_size=chunk_size, threads=threads):
            assert 0 < len(data) <= chunk_size
            threads.add(threading.get_ident())
            got.append(bytes(data))

        n = min(len(expected), 1_500_000)
        await stream.receive_into(n, sink, 10.0, chunk_size)
        assert b"".join(got) == expected[:n]
        assert threading.get_ident() not in threads  # never on the event loop
        expected = expected[n:]
        if not expected:
            break
    rest = b""
    while data := await stream.read(1 << 20):
        rest += data
    assert rest == expected


async def test_receive_into_reports_a_stall_and_an_early_end(make_node):
    release = asyncio.Event()

    async def handler(peer, stream):
        await stream.write(b"x" * 1000)
        await release.wait()
        await stream.close()

    _, stream = await pair(make_node, handler)
    got: list[bytes] = []
    with pytest.raises(StreamError) as stall:
        await stream.receive_into(5000, got.append, 0.5, 1 << 20)
    assert stall.value.reason == "timeout" and b"".join(got) == b"x" * 1000
    release.set()
    with pytest.raises(StreamError) as end:
        await stream.receive_into(10, got.append, 5.0, 1 << 20)
    assert end.value.reason == "eof"


async def test_a_cancelled_receive_calls_the_sink_no_more(make_node):
    """Cancelled mid-body: once the caller sees the cancellation, no sink call runs or
    starts (the caller may then close the file the sink writes), and the stream can be
    reset."""
    more = asyncio.Event()
    written_after = []

    async def handler(peer, stream):
        await stream.write(os.urandom(300_000))
        await more.wait()
        for _ in range(20):  # more than the window: the later writes wait for it
            await stream.write(os.urandom(300_000))
            written_after.append(1)
        await stream.close()

    async def echo(peer, body):
        return body

    server = await make_node(discovery=False)
    client = await make_node(bootstrap=server.listen_addrs, discovery=False)
    await server.set_stream_handler(PROTO, handler, max_inbound=1 << 20)
    await server.set_request_handler("/t/echo/1", echo)
    stream = await client.open_stream(server.peer_id, PROTO)
    calls: list[int] = []
    in_sink = threading.Event()

    def sink(data):
        in_sink.set()
        calls.append(len(data))

    task = asyncio.create_task(stream.receive_into(50 << 20, sink, 30.0, 1 << 16))
    await wait_until(in_sink.is_set, what="first chunk")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    seen = len(calls)
    more.set()
    # the server sends 1.2 MB more, then answers a request on the same connection: its
    # answer comes after those bytes, so they were all received here before it
    await wait_until(lambda: len(written_after) >= 4, 30, what="1.2 MB more sent")
    assert await client.request(server.peer_id, "/t/echo/1", b"after") == b"after"
    assert len(calls) == seen  # nothing reached the sink
    await stream.reset()


async def test_small_reads_send_no_window_updates_and_bulk_reads_few(make_node, monkeypatch):
    """Credit goes back once half the window was read, not after every read: 200 small
    request/answer turns send no WINDOW_UPDATE at all (py-libp2p 0.8.1 sent one per read at
    each end, ~400 here), and 8 MiB of bulk reads send a handful, with every byte intact."""
    import libp2p.stream_muxer.yamux.yamux as yamux_mod

    updates: list[tuple[int, int]] = []  # (yamux stream id, delta), at either end
    update = yamux_mod.YamuxStream.send_window_update

    async def counted(self, delta, *args, **kwargs):  # the real frame still goes out
        updates.append((self.stream_id, delta))
        return await update(self, delta, *args, **kwargs)

    monkeypatch.setattr(yamux_mod.YamuxStream, "send_window_update", counted)
    turns, size = 200, 300
    bulk = os.urandom(8 << 20)

    async def handler(peer, stream):
        for i in range(turns):
            assert await stream.readexactly(size) == bytes([i % 256]) * size
            await stream.write(b"k")
        await stream.write(bulk)
        await stream.close()

    _, stream = await pair(make_node, handler)
    ours = stream._stream.muxed_stream.stream_id  # the same id at both ends

    def sent() -> list[int]:  # not the connection's set-up streams (identify, ...)
        return [delta for sid, delta in updates if sid == ours]

    for i in range(turns):
        await stream.write(bytes([i % 256]) * size)
        assert await stream.readexactly(1) == b"k"
    assert sent() == []  # 60 KB each way, in 200 reads at each end
    got = bytearray()
    while data := await stream.read(1 << 20):
        got += data
    assert got == bulk
    # one grant up to the bulk window, then one per 2 MiB read
    assert 1 <= len(sent()) <= 8, sent()
