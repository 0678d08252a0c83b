"""The download's endgame (downloader.py): once every missing shard is in flight, a transfer
from a slow source is raced by a second copy from another source; the first copy that
verifies goes in place, the other transfer is cancelled, and the slow source is not held
responsible. Over TCP on 127.0.0.1 with real shard servers and files; the slow source's
uploads are capped by its own rate limiter (a home uplink serving many peers at once)."""

from __future__ import annotations

import asyncio
import time

from swarm_node.node.broadcast.downloader import HOLD_BACK_S, Downloader
from swarm_node.node.broadcast.server import RateLimiter, ShardServer
from swarm_node.node.broadcast.sources import SourceBook
from swarm_node.node.broadcast.store import ShardStore
from swarm_node.node.broadcast.transport import TcpTransport, serve_tcp

from tests.waiting import async_wait_until

from .conftest import publish, read_dir
from .test_transfer import CorruptStore


async def _serve(tmp_path, name, acc, ckpt, cfg, store_cls=ShardStore, **kw):
    store = store_cls(tmp_path / name, **kw)
    store.add_checkpoint(acc, ckpt)
    server = ShardServer(store, cfg)
    tcp = await serve_tcp(server.handle, "127.0.0.1", 0)
    return server, tcp, f"127.0.0.1:{tcp.sockets[0].getsockname()[1]}"


async def _race(tmp_path, trainer, ckpt, cfg, second_store=ShardStore, endgame=True,
                unmeasured=False, **kw):
    """Every shard but 0 in flight from a slow source; shard 0 came from a second source
    (so its rate is measured: unmeasured sources are not raced), which then advertises
    every shard (`unmeasured`: so does a third source, never asked yet)."""
    cfg = cfg.model_copy(update={"parallel_downloads": 8, "per_source_downloads": 8,
                                  "max_uploads_per_peer": 8, "endgame": endgame,
                                  "chunk_timeout_s": 10.0})  # the slow source is slow
    acc = publish(trainer, ckpt, 1, cfg.shard_size)
    n = acc.manifest.num_shards
    slow, slow_tcp, slow_addr = await _serve(tmp_path, "slow", acc, ckpt, cfg)
    slow.limiter = RateLimiter(48 * 1024)  # the whole checkpoint in ~7 s
    other, other_tcp, other_addr = await _serve(tmp_path, "other", acc, ckpt, cfg,
                                                second_store, **kw)
    other.limiter = RateLimiter(1 << 30)  # not sendfile: its bytes pass `read_shard`
    third, third_tcp, third_addr = await _serve(tmp_path, "third", acc, ckpt, cfg)
    third.limiter = RateLimiter(48 * 1024)
    try:
        store = ShardStore(tmp_path / "client")
        entry = store.open_version(acc)
        book = SourceBook(per_source=8, max_corrupt=100)
        book.add(slow_addr, set(range(1, n)), proven=True)  # proven: not on trial
        book.add(other_addr, {0}, proven=True)
        d = Downloader(store, entry, TcpTransport(), book, cfg)
        task = asyncio.create_task(d.run())
        # every missing shard in flight (the small last shard may be done already)
        await async_wait_until(lambda: 0 in entry.have and d.flights
                               and len(d.flights) + len(entry.have) == n,
                               30, "every missing shard in flight")
        book.add(other_addr, None)  # its advert arrives
        if unmeasured:  # an advertiser on trial, also slow if it were asked
            book.add(third_addr, None)
        d.sources_changed()
        path = await asyncio.wait_for(task, 30)
        return d, book, path, slow_addr, other_addr, acc
    finally:
        for tcp in (slow_tcp, other_tcp, third_tcp):
            tcp.close()
            await tcp.wait_closed()


async def test_a_slow_sources_last_shards_are_raced_and_the_first_copy_wins(
        tmp_path, trainer, ckpt, cfg):
    d, book, path, slow, other, acc = await _race(tmp_path, trainer, ckpt, cfg)
    assert read_dir(path) == read_dir(ckpt)
    assert d.metrics["endgame_won"] >= 1, dict(d.metrics)
    assert book.sources[other].shards_ok == d.metrics["endgame_won"] + 1
    # the slower copies were cancelled, not held against their source
    assert d.metrics["endgame_first_lost"] == d.metrics["endgame_won"]
    s = book.sources[slow]
    assert s.failures == 0 and not s.dropped and s.corrupt == 0
    # bounded: at most one extra shard per transfer in flight at the endgame
    assert d.metrics["endgame_bytes"] <= acc.manifest.num_shards * cfg.shard_size
    assert d.metrics["shards_ok"] == acc.manifest.num_shards
    wasted = d.metrics["endgame_bytes_wasted"]  # the slow transfers' bytes so far
    assert 0 < wasted < d.metrics["endgame_won"] * cfg.shard_size


async def test_the_flight_log_tells_each_transfer_and_how_it_ended(tmp_path, trainer, ckpt,
                                                                   cfg):
    """Benchmarks read where a download's time went from `flight_log`: every transfer,
    first copies and endgame copies, with its source, outcome and bytes."""
    d, _book, _path, slow, other, acc = await _race(tmp_path, trainer, ckpt, cfg)
    log = list(d.flight_log)
    ok = {shard for _s, _e, shard, _p, outcome, _n in log if outcome in ("ok", "spare_ok")}
    assert ok == set(range(acc.manifest.num_shards)), log
    assert all(s <= e for s, e, *_ in log)
    won = [r for r in log if r[4] == "spare_ok"]
    assert len(won) == d.metrics["endgame_won"] and all(r[3] == other for r in won)
    lost = [r for r in log if r[4] == "lost"]
    assert len(lost) == d.metrics["endgame_first_lost"] and all(r[3] == slow for r in lost)
    assert all(r[5] == d.entry.shard_len(r[2]) for r in log if r[4] == "ok")


async def test_a_source_not_measured_yet_does_not_hide_the_measured_one(
        tmp_path, trainer, ckpt, cfg):
    """An advertiser on trial that holds the shards ranks first in the source choice; the
    endgame never races from it, and still races from the measured source. Before, it
    took the unmeasured one, skipped the shard, and the download waited for the slow
    source (measured in the simulated WAN: 12 s on a 0.15 MiB/s uplink for the last
    shard, a relay that held it idle)."""
    d, book, path, _slow, other, _acc = await _race(tmp_path, trainer, ckpt, cfg,
                                                    unmeasured=True)
    assert read_dir(path) == read_dir(ckpt)
    assert d.metrics["endgame_won"] >= 1, dict(d.metrics)
    assert book.sources[other].shards_ok == d.metrics["endgame_won"] + 1


async def test_a_corrupt_endgame_copy_never_lands(tmp_path, trainer, ckpt, cfg):
    """The second copy is hashed before it touches the files: a source that sends wrong
    bytes (for every shard but 0) is penalised and the slow honest transfer completes the shard."""
    d, book, path, slow, other, acc = await _race(
        tmp_path, trainer, ckpt, cfg, CorruptStore, bad=set(range(1, 64)))
    assert read_dir(path) == read_dir(ckpt)
    assert d.metrics["endgame_copies"] >= 1 and d.metrics["endgame_won"] == 0
    assert d.metrics["shards_corrupt"] >= 1 and book.sources[other].corrupt >= 1
    assert book.sources[slow].shards_ok == acc.manifest.num_shards - 1
    assert book.sources[slow].failures == 0


async def test_with_the_endgame_off_the_download_waits_for_the_slow_source(
        tmp_path, trainer, ckpt, cfg):
    d, book, path, slow, _other, acc = await _race(tmp_path, trainer, ckpt, cfg,
                                                   endgame=False)
    assert read_dir(path) == read_dir(ckpt)
    assert not any(k.startswith("endgame_") for k in d.metrics), dict(d.metrics)
    assert book.sources[slow].shards_ok == acc.manifest.num_shards - 1


def test_a_holders_seeded_is_asked_again_soon_the_trainers_later(tmp_path, trainer, ckpt,
                                                                 cfg, monkeypatch):
    """`seeded` from the trainer holds that shard back from it 1 s, doubling per answer; from
    another holder (its per-shard upload bound) 1 s each time. Before, both doubled."""
    acc = publish(trainer, ckpt, 1, cfg.shard_size)
    store = ShardStore(tmp_path / "client")
    book = SourceBook(per_source=4, max_corrupt=1)
    book.add("trainer", None, origin=True)
    book.add("holder", None, proven=True)
    d = Downloader(store, store.open_version(acc), TcpTransport(), book, cfg)
    monkeypatch.setattr(time, "monotonic", lambda: 100.0)  # the clock the holds read
    for _ in range(3):
        d._hold_back(0, "trainer")
        d._hold_back(0, "holder")
    assert d.held[0]["holder"] == (100.0 + HOLD_BACK_S, 3)
    assert d.held[0]["trainer"] == (100.0 + 4 * HOLD_BACK_S, 3)
