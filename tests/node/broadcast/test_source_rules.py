"""Issue 30 "Sources", with real libp2p hosts on 127.0.0.1: advertisers that never serve
(and one that left) do not stall a download while the trainer serves it. Issue 27: an
advertiser on trial that fails once (a broken stream) is asked again and serves (real shard
servers over TCP)."""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter

from swarm_node.node.broadcast.adverts import Adverts
from swarm_node.node.broadcast.downloader import Downloader
from swarm_node.node.broadcast.records import VersionRecords
from swarm_node.node.broadcast.server import RateLimiter, ShardServer
from swarm_node.node.broadcast.sources import ProvenPeers, SourceBook
from swarm_node.node.broadcast.store import ShardStore
from swarm_node.node.broadcast.transport import TcpTransport, serve_tcp
from swarm_node.node.config import load_config
from swarm_node.node.identity import Identity
from swarm_node.protocol.ids import SHARD_PROTOCOL
from swarm_node.protocol.messages import ShardAdvert

from tests.waiting import async_wait_until

from .conftest import make_checkpoint, node_config, publish, read_dir, until, wait_mesh

STALLERS = 5


class Staller:
    """A real host that advertises the trainer's version as complete and, asked for a
    shard, takes the request and never answers (until the test ends)."""

    held = peak = 0  # transfers held by all stallers now / at most at once

    def __init__(self, node, release: asyncio.Event):
        self.node, self.release, self.requests = node, release, 0

    async def handle(self, peer: str, stream) -> None:
        self.requests += 1
        Staller.held += 1
        Staller.peak = max(Staller.peak, Staller.held)
        try:  # hold it until the asker gives up (its stream ends) or the test ends
            reading = asyncio.ensure_future(_until_closed(stream))
            released = asyncio.ensure_future(self.release.wait())
            await asyncio.wait([reading, released], return_when=asyncio.FIRST_COMPLETED)
            for f in (reading, released):
                f.cancel()
        finally:
            Staller.held -= 1


async def _until_closed(stream) -> None:
    with contextlib.suppress(Exception):  # reset by the asker: what we wait for
        while await stream.read(65536):
            pass


def _count_trials(monkeypatch):
    """Record the most trial transfers a follower's source book had at once."""
    started = SourceBook.started
    trials = type("Trials", (), {"peak": 0})()

    def counting(book, peer: str) -> None:
        started(book, peer)
        on_trial = sum(s.in_flight for s in book.sources.values() if not s.good)
        trials.peak = max(trials.peak, on_trial)
    monkeypatch.setattr(SourceBook, "started", counting)
    return trials


async def advertiser(bootstrap: list[str]):
    from swarm_node.node.p2p import P2PNode

    cfg = load_config(None, {"node.listen": ["/ip4/127.0.0.1/tcp/0"], "p2p.mesh_wait_s": 3})
    node = P2PNode(Identity.generate(), cfg)
    await node.start(bootstrap=bootstrap)
    await node.subscribe("adverts", _ignore)
    return node


async def advertise_until(nodes, ad: ShardAdvert, done, what: str) -> None:
    """Publish `ad` from each of `nodes` again every 0.2 s until `done()` (their re-advert
    pace: an advert may go out before the follower's mesh holds them), at most 30 s."""
    async def again() -> bool:
        if not done():
            await asyncio.gather(*(n.publish("adverts", ad) for n in nodes),
                                 return_exceptions=True)
        return done()
    await async_wait_until(again, 30, what, interval=0.2)


async def _ignore(env, peer) -> None:
    pass


async def test_stalling_and_departed_advertisers_do_not_stall_the_download(tmp_path, swarm,
                                                                           monkeypatch):
    trials = _count_trials(monkeypatch)
    ckpt = make_checkpoint(tmp_path / "ckpt", {"model.safetensors": 1_000_000})  # 16 shards
    tnode, trainer = await swarm("trainer", "trainer")
    tid = tnode.peer_id
    # a staller would hold a transfer for a minute: the download must not wait for that
    cfg = node_config(broadcast__request_timeout_s=60, broadcast__chunk_timeout_s=60,
                      broadcast__parallel_downloads=4)  # two trial slots
    fnode, follower = await swarm("follower", "inference", follow=[tid],
                                  bootstrap=tnode.listen_addrs, cfg=cfg)
    release = asyncio.Event()
    stallers = []
    Staller.held = Staller.peak = 0
    try:
        for _ in range(STALLERS):
            node = await advertiser(fnode.listen_addrs)
            s = Staller(node, release)
            node.set_stream_handler(SHARD_PROTOCOL, s.handle)
            stallers.append(s)
        departed = await advertiser(fnode.listen_addrs)
        ad = ShardAdvert(policy_id=tid, version=1, complete=True)
        nodes = [s.node for s in stallers] + [departed]

        def admitted() -> int:
            rec = follower.records.get((tid, 1))
            return len(rec.holders) if rec is not None else 0
        # they advertise before the version is out
        await advertise_until(nodes, ad, lambda: admitted() >= len(nodes), "every advert")
        await departed.close()  # its advert stays behind
        await wait_mesh(tnode, "checkpoints", 1)
        m = await trainer.publish(ckpt, version=1)
        # within the stallers' 60 s: no transfer of theirs timed out to free a slot
        done = await follower.done.wait(tid, 1, timeout=45)
        assert read_dir(done.path) == read_dir(ckpt)
        # a trial each, and again after a cooldown at most `trial_failures` times in all
        assert all(s.requests <= cfg.broadcast.trial_failures for s in stallers)
        # never every slot: the follower's trial transfers at once (a staller may still
        # hold a request its asker gave up, until it sees the stream's reset)
        assert trials.peak <= cfg.broadcast.parallel_downloads // 2
        # the trials still held at the end were taken back, not waited for
        assert done.metrics.get("fail_preempted", 0) >= 1 or not Staller.peak
        assert done.sources[tid]["shards_ok"] == m.num_shards - done.metrics.get(
            "shards_resumed", 0)
        assert done.sources[departed.peer_id]["shards_ok"] == 0
    finally:
        release.set()
        await asyncio.gather(*(s.node.close() for s in stallers), return_exceptions=True)


async def test_a_source_on_trial_that_keeps_timing_out_is_dropped(tmp_path, swarm):
    """The deadline: a staller's transfer that times out costs it a trial; after a cooldown
    it is asked again, and at its `trial_failures`-th timeout it is dropped for the version;
    the trainer serves the rest."""
    ckpt = make_checkpoint(tmp_path / "ckpt", {"model.safetensors": 600_000})
    tnode, trainer = await swarm("trainer", "trainer")
    tid = tnode.peer_id
    cfg = node_config(broadcast__request_timeout_s=1.0, broadcast__parallel_downloads=2,
                      broadcast__trial_failures=2)
    fnode, follower = await swarm("follower", "inference", follow=[tid],
                                  bootstrap=tnode.listen_addrs, cfg=cfg)
    release = asyncio.Event()
    node = await advertiser(fnode.listen_addrs)
    staller = Staller(node, release)
    node.set_stream_handler(SHARD_PROTOCOL, staller.handle)
    try:
        trainer.server.limiter = RateLimiter(128 * 1024)  # ~5 s: the staller comes first
        await wait_mesh(tnode, "checkpoints", 1)
        await trainer.publish(ckpt, version=1)
        await until(lambda: follower.follower.jobs.get(tid) is not None, what="the download")
        ad = ShardAdvert(policy_id=tid, version=1, complete=True)

        def admitted() -> bool:
            rec = follower.records.get((tid, 1))
            return rec is not None and node.peer_id in rec.holders
        await advertise_until([node], ad, admitted, "the staller's advert")
        done = await follower.done.wait(tid, 1)
        assert read_dir(done.path) == read_dir(ckpt)
        assert staller.requests == 2
        assert done.sources[node.peer_id]["dropped"]
        assert done.metrics.get("fail_timeout", 0) + done.metrics.get("fail_preempted", 0) == 2
    finally:
        release.set()
        await node.close()


class FailsFirst:
    """A shard server that breaks the stream of its first request without an answer (an
    honest peer that was overloaded, or lost the connection) and serves every later one."""

    def __init__(self, server: ShardServer):
        self.server, self.requests = server, 0

    async def handle(self, peer: str, stream) -> None:
        self.requests += 1
        if self.requests == 1:
            await stream.close()
            return
        await self.server.handle(peer, stream)


async def _serve(handler):
    tcp = await serve_tcp(handler, "127.0.0.1", 0)
    return tcp, f"127.0.0.1:{tcp.sockets[0].getsockname()[1]}"


async def test_an_advertiser_on_trial_that_fails_once_is_asked_again_and_serves(
        tmp_path, trainer, ckpt, cfg):
    """Issue 27: a trial source's first failure to serve does not lose it for the version
    (before, it was dropped at once, and the trainer served every shard)."""
    acc = publish(trainer, ckpt, 1, cfg.shard_size)
    servers = []
    for name in ("trainer", "peer"):
        store = ShardStore(tmp_path / name)
        store.add_checkpoint(acc, ckpt)
        servers.append(ShardServer(store, cfg))
    servers[0].limiter = RateLimiter(48 * 1024)  # the checkpoint in ~7 s: a retry has time
    flaky = FailsFirst(servers[1])
    (origin_tcp, origin), (peer_tcp, peer) = await _serve(servers[0].handle), await _serve(
        flaky.handle)
    try:
        store = ShardStore(tmp_path / "follower")
        book = SourceBook(per_source=4, max_corrupt=1, trial_failures=cfg.trial_failures)
        book.add(origin, None, origin=True)
        book.add(peer, None)  # an advertiser on trial
        d = Downloader(store, store.open_version(acc), TcpTransport(), book, cfg)
        path = await asyncio.wait_for(d.run(), 30)
        assert read_dir(path) == read_dir(ckpt)
        s = book.sources[peer]
        assert d.metrics["fail_short_read"] == 1 and flaky.requests >= 2
        assert not s.dropped and s.shards_ok >= 1  # asked again after its cooldown: served
    finally:
        for tcp in (origin_tcp, peer_tcp):
            tcp.close()
            await tcp.wait_closed()


def test_the_slot_of_an_advertiser_dropped_on_trial_is_given_back(tmp_path):
    """max_unproven_sources counts the advertisers still in use: one dropped on trial frees
    its slot for the next advertiser, up to `unproven_refills` x the slots per version (1:
    never, the rule before)."""
    store = ShardStore(tmp_path / "s")
    records = VersionRecords(store)
    cfg = node_config().broadcast.model_copy(update={"max_unproven_sources": 1})
    adverts = Adverts(None, cfg, store, records, Counter(), ProvenPeers(),
                      follows=lambda p: True)
    rec = records.track(("trainer", 1))
    rec.book = book = SourceBook(per_source=4, max_corrupt=1, trial_failures=1)
    before = Adverts(None, cfg.model_copy(update={"unproven_refills": 1}), store, records,
                     Counter(), ProvenPeers(), follows=lambda p: True)
    assert adverts._admit(rec, "a", "10.0.0.1:4002")
    rec.remember("a", None)
    assert not adverts._admit(rec, "b", "10.0.0.2:4002")  # the one slot is a's
    book.failure("a", "open_failed")  # a's trial failed: dropped for the version
    assert book.sources["a"].dropped
    assert not before._admit(rec, "b", "10.0.0.2:4002")  # the rule before: a's for good
    for i in range(cfg.unproven_refills - 1):  # each dropped one frees the slot again
        peer = f"p{i}"
        assert adverts._admit(rec, peer, f"10.0.1.{i}:4002")
        rec.remember(peer, None)
        assert not adverts._admit(rec, "b", "10.0.0.2:4002")
        book.failure(peer, "timeout")
    assert not adverts._admit(rec, "b", "10.0.0.2:4002")  # 4 admitted in all: no more
    assert adverts._admit(rec, "trainer", "")  # the trainer always


def test_the_slot_of_an_advertiser_that_delivered_is_given_back(tmp_path):
    """An advertiser that delivered a verified shard is a known-good source: its slot goes
    to the next advertiser, and it does not count against the refills bound (only trials
    that delivered nothing do). Before, it kept its slot for the version."""
    store = ShardStore(tmp_path / "s")
    records = VersionRecords(store)
    cfg = node_config().broadcast.model_copy(update={"max_unproven_sources": 1,
                                                     "unproven_refills": 1})
    proven = ProvenPeers()
    adverts = Adverts(None, cfg, store, records, Counter(), proven, follows=lambda p: True)
    rec = records.track(("trainer", 1))
    rec.book = book = SourceBook(per_source=4, max_corrupt=1, trial_failures=1)
    for i in range(5):  # each delivers a shard: the one slot passes on each time
        peer = f"p{i}"
        assert adverts._admit(rec, peer, f"10.0.1.{i}:4002")
        rec.remember(peer, None)
        assert not adverts._admit(rec, "b", "10.0.0.2:4002")  # on trial: the slot is taken
        book.success(peer, 1000, 0.1)
        proven.add(peer)  # what a verified shard does (Downloader.on_verified)
    assert adverts._admit(rec, "b", "10.0.0.2:4002")
    rec.remember("b", None)
    book.failure("b", "open_failed")  # dropped on trial: the one refill is spent
    assert not adverts._admit(rec, "c", "10.0.0.3:4002")


async def test_holders_beyond_the_slots_serve_once_the_first_delivered(tmp_path, swarm):
    """One unproven slot and three holders of the version, each uploading slowly: the
    holder admitted first delivers, its slot passes to the next advertiser, and every
    holder serves part of the download. Before, the first holder kept the slot for the
    version and served every shard the trainer did not."""
    ckpt = make_checkpoint(tmp_path / "ckpt", {"model.safetensors": 1_000_000})  # 16 shards
    tnode, trainer = await swarm("trainer", "trainer")
    tid = tnode.peer_id
    holders = [await swarm(f"h{i}", "inference", follow=[tid], bootstrap=tnode.listen_addrs)
               for i in range(3)]
    for node, _ in holders:
        await wait_mesh(node, "checkpoints", 1)
    await trainer.publish(ckpt, version=1)
    for _, bc in holders:
        await bc.done.wait(tid, 1)
        bc.server.limiter = RateLimiter(96 * 1024)  # a home uplink: ~11 s for all of it
    trainer.server.limiter = RateLimiter(16 * 1024)  # the trainer gives it out once
    cfg = node_config(broadcast__max_unproven_sources=1)
    boot = [a for node, _ in holders for a in node.listen_addrs]
    _, follower = await swarm("follower", "inference", follow=[tid], cfg=cfg,
                              bootstrap=tnode.listen_addrs + boot)
    done = await follower.done.wait(tid, 1, timeout=90)
    assert read_dir(done.path) == read_dir(ckpt)
    served = {node.peer_id[-6:]: done.sources.get(node.peer_id, {}).get("shards_ok", 0)
              for node, _ in holders}
    assert all(served.values()), (served, done.sources)


async def test_a_holder_heard_after_a_dropped_advertiser_serves(tmp_path, swarm):
    """One unproven slot, taken by an advertiser that never answers: once it is dropped on
    trial, the slot is given back and a follower that holds shards is admitted and serves
    some of them. Before, the slot stayed taken for the version: the holder was never a
    source, and the shards the trainer had handed to it came from the trainer again."""
    ckpt = make_checkpoint(tmp_path / "ckpt", {"model.safetensors": 600_000})
    tnode, trainer = await swarm("trainer", "trainer")
    tid = tnode.peer_id
    cfg = node_config(broadcast__request_timeout_s=1.0, broadcast__parallel_downloads=2,
                      broadcast__trial_failures=1, broadcast__max_unproven_sources=1)
    fnode, follower = await swarm("follower", "inference", follow=[tid],
                                  bootstrap=tnode.listen_addrs, cfg=cfg)
    hnode, _ = await swarm("holder", "inference", follow=[tid],
                           bootstrap=tnode.listen_addrs + fnode.listen_addrs)
    release = asyncio.Event()
    node = await advertiser(fnode.listen_addrs)
    staller = Staller(node, release)
    node.set_stream_handler(SHARD_PROTOCOL, staller.handle)
    try:
        ad = ShardAdvert(policy_id=tid, version=1, complete=True)

        def admitted() -> bool:
            rec = follower.records.get((tid, 1))
            return rec is not None and node.peer_id in rec.holders
        await advertise_until([node], ad, admitted, "the staller's advert")
        trainer.server.limiter = RateLimiter(128 * 1024)  # ~5 s: the swarm matters
        await wait_mesh(tnode, "checkpoints", 2)
        await trainer.publish(ckpt, version=1)
        done = await follower.done.wait(tid, 1)
        assert read_dir(done.path) == read_dir(ckpt)
        assert done.sources[node.peer_id]["dropped"]
        assert done.sources.get(hnode.peer_id, {}).get("shards_ok", 0) > 0, done.sources
    finally:
        release.set()
        await node.close()
