"""The trainer hands each shard of its checkpoint to the swarm about once (seeding.py) and
followers take the other copies from each other: the rule alone, through the shard
protocol, and with real libp2p hosts on 127.0.0.1 whose trainer uplink is the bottleneck."""

from __future__ import annotations

import asyncio

from swarm_node.node.broadcast import downloader
from swarm_node.node.broadcast.downloader import Downloader
from swarm_node.node.broadcast.seeding import (
    ASKER_WAIT_HOLDS,
    EXTRA_BACKOFF,
    MAX_ASKER_WAIT_S,
    Seeding,
)
from swarm_node.node.broadcast.server import RateLimiter, ShardServer
from swarm_node.node.broadcast.sources import SourceBook
from swarm_node.node.broadcast.store import ShardStore
from swarm_node.node.broadcast.transport import MemoryTransport
from swarm_node.protocol.messages import ShardAdvert

from tests.waiting import async_wait_until

from .conftest import make_checkpoint, publish, read_dir, wait_mesh


def _advert(version: int, shards: set[int] | None, n: int = 8) -> ShardAdvert:
    if shards is None:
        return ShardAdvert(policy_id="trainer", version=version, complete=True)
    have = bytearray((n + 7) // 8)
    for i in shards:
        have[i // 8] |= 1 << (i % 8)
    return ShardAdvert(policy_id="trainer", version=version, complete=False, have=bytes(have))


def test_each_shard_once_then_again_only_once_the_swarm_stopped_carrying_it():
    now = [0.0]
    s = Seeding("trainer", copies=1, hold_s=5.0, clock=lambda: now[0])
    key = ("trainer", 1)
    assert s.take(key, 0, "a") and not s.take(key, 0, "b")  # one copy, then `seeded`
    assert s.take(key, 1, "a")
    s.give_back(key, 1)  # that upload failed: the next asker gets it
    assert s.take(key, 1, "b")
    now[0] = 9.0
    assert not s.take(key, 0, "c")  # its upload is still going: held whatever the time
    s.delivered(key, 0)
    s.delivered(key, 1)
    now[0] = 100.0  # long after: nobody asked since, so nothing says the swarm stalled
    assert not s.take(key, 0, "d")  # this ask starts the hold
    s.heard("a", _advert(1, {0}), 8)  # the peer given the copy: no sign of spreading
    now[0] = 104.9
    assert not s.take(key, 0, "e")
    now[0] = 105.0  # nobody carried it within the hold of the first unanswered ask
    assert s.take(key, 0, "e") and not s.take(key, 0, "f")
    assert s.copies_of(key) == 3 and s.released == {"stalled": 1, "waited": 0}
    assert s.take(("someone else", 1), 0) and s.take(("someone else", 1), 0)  # not its own
    off = Seeding("trainer", copies=0, hold_s=5.0)
    assert all(off.take(key, 0) for _ in range(3))


def test_no_copy_again_while_holders_serve_it_on():
    """New holders of a shard (advertised by peers the trainer did not give it to) restart
    its hold: the trainer does not hand it out while the swarm carries it."""
    now = [0.0]
    s = Seeding("trainer", copies=1, hold_s=5.0, clock=lambda: now[0])
    key = ("trainer", 1)
    assert s.take(key, 0, "a")
    s.delivered(key, 0)
    for t, peer in ((0.0, "b"), (4.0, "c"), (8.0, "d")):  # each got it from a holder
        now[0] = t
        assert not s.take(key, 0, "x" + peer)  # 4 s apart: never 5 s unanswered
        now[0] = t + 4.0
        s.heard(peer, _advert(1, {0}), 8)
    now[0] = 12.0
    assert not s.take(key, 0, "y")  # a new hold starts
    s.heard("d", _advert(1, {0}), 8)  # a readvert names nothing new: no sign
    now[0] = 16.0
    s.heard("e", _advert(1, None), 8)  # a complete version names shard 0 anew
    now[0] = 20.9
    assert not s.take(key, 0, "y")  # the hold restarted at 20.9
    now[0] = 25.9
    assert s.take(key, 0, "y") and s.copies_of(key) == 2
    assert s.released == {"stalled": 1, "waited": 0}


def test_an_asker_that_waited_long_enough_gets_a_copy():
    """Whatever the adverts claim (holders it cannot reach, or advertisers that never
    serve), an asker answered `seeded` for ASKER_WAIT_HOLDS holds gets its copy."""
    now = [0.0]
    s = Seeding("trainer", copies=1, hold_s=5.0, clock=lambda: now[0])
    key = ("trainer", 1)
    assert s.take(key, 0, "a")
    s.delivered(key, 0)
    assert not s.take(key, 0, "nat")  # its wait starts
    wait = ASKER_WAIT_HOLDS * 5.0
    for i in range(int(wait)):  # a new (sybil) holder every second keeps the shard held
        now[0] = float(i)
        s.heard(f"sybil{i}", _advert(1, {0}), 8)
        assert not s.take(key, 0, "other")
    now[0] = wait
    s.heard("sybil-last", _advert(1, {0}), 8)
    assert s.take(key, 0, "nat")  # its wait is over
    assert not s.take(key, 0, "nat2")  # the others' is not
    assert s.released == {"stalled": 0, "waited": 1}


def _store(tmp_path, name, acc, ckpt=None):
    store = ShardStore(tmp_path / name)
    if ckpt is not None:
        store.add_checkpoint(acc, ckpt)
        return store, store.get(acc.manifest.policy_id, 1)
    return store, store.open_version(acc)


async def test_a_seeded_answer_sends_the_follower_to_a_peer(tmp_path, trainer, ckpt, cfg):
    """Through the shard protocol: the trainer's second asker gets `seeded` for every shard
    (its stream kept), takes them from the peer that holds them once it learns of it, and
    the trainer sent the checkpoint once in all."""
    acc = publish(trainer, ckpt, 1, cfg.shard_size)
    tstore, _ = _store(tmp_path, "trainer", acc, ckpt)
    origin = ShardServer(tstore, cfg)
    origin.seeding = Seeding(trainer.peer_id, copies=1, hold_s=60.0)
    origin.enable_trace()
    t = MemoryTransport()
    t.register(trainer.peer_id, origin.serve_connection)
    total = acc.manifest.total_size

    pstore, pentry = _store(tmp_path, "first", acc)
    book = SourceBook(per_source=cfg.per_source_downloads, max_corrupt=1)
    book.add(trainer.peer_id, None, origin=True)
    assert read_dir(await Downloader(pstore, pentry, t, book, cfg).run()) == read_dir(ckpt)
    assert origin.metrics["bytes_sent"] == total
    t.register("first", ShardServer(pstore, cfg).serve_connection)

    store, entry = _store(tmp_path, "second", acc)
    book = SourceBook(per_source=cfg.per_source_downloads, max_corrupt=1)
    book.add(trainer.peer_id, None, origin=True)
    d = Downloader(store, entry, t, book, cfg)
    task = asyncio.create_task(d.run())
    await async_wait_until(lambda: origin.metrics["error_seeded"] >= acc.manifest.num_shards,
                           30, "a `seeded` answer for every shard")
    book.add("first", None)  # its advert arrives
    d.sources_changed()
    assert read_dir(await asyncio.wait_for(task, 30)) == read_dir(ckpt)
    assert origin.metrics["bytes_sent"] == total  # nothing more from the trainer
    assert book.sources["first"].shards_ok == acc.manifest.num_shards
    assert not book.sources[trainer.peer_id].failures  # `seeded` is no fault
    assert d.metrics["seeded"] >= acc.manifest.num_shards
    outcomes = [(shard, outcome) for _s, _e, _v, shard, _p, outcome in origin.trace]
    assert sorted(sh for sh, o in outcomes if o == "sent") == list(range(acc.manifest.num_shards))
    assert sum(o == "seeded" for _sh, o in outcomes) == origin.metrics["error_seeded"]


async def _seeded_then_slow_holder(tmp_path, trainer, cfg, rate: int):
    """A trainer that answered `seeded` for every shard to a second follower, whose only
    other source is a first follower serving at `rate` bytes/s, on trial (its advert came
    after the answers): (checkpoint, its
    manifest, trainer's server, the second's book, downloader, its task)."""
    ckpt = make_checkpoint(tmp_path / "ckpt", {"model.safetensors": 3 * cfg.shard_size})
    acc = publish(trainer, ckpt, 1, cfg.shard_size)
    tstore, _ = _store(tmp_path, "trainer", acc, ckpt)
    origin = ShardServer(tstore, cfg)
    origin.seeding = Seeding(trainer.peer_id, copies=1, hold_s=0.1)
    t = MemoryTransport()
    t.register(trainer.peer_id, origin.serve_connection)

    pstore, pentry = _store(tmp_path, "first", acc)
    book = SourceBook(per_source=cfg.per_source_downloads, max_corrupt=1)
    book.add(trainer.peer_id, None, origin=True)
    await Downloader(pstore, pentry, t, book, cfg).run()
    slow = ShardServer(pstore, cfg)
    slow.limiter = RateLimiter(rate)
    t.register("first", slow.serve_connection)

    store, entry = _store(tmp_path, "second", acc)
    book = SourceBook(per_source=cfg.per_source_downloads, max_corrupt=1, trial_slots=1)
    book.add(trainer.peer_id, None, origin=True)
    d = Downloader(store, entry, t, book, cfg)
    task = asyncio.create_task(d.run())
    await async_wait_until(lambda: origin.metrics["error_seeded"] >= acc.manifest.num_shards,
                           30, "a `seeded` answer for every shard")
    book.add("first", None)  # its advert arrives: an advertiser on trial
    d.sources_changed()
    return ckpt, acc.manifest, origin, book, d, task


async def test_a_follower_waits_for_holders_on_trial_instead_of_asking_again(
        tmp_path, trainer, cfg):
    """Through the shard protocol: the trainer answered `seeded` for every shard; the one
    holder is unproven and slow, so its trial (one transfer at a time) outlasts the
    follower's hold-back on the trainer. The follower waits for that holder rather than
    asking the trainer again, whose own rule would then hand it copies (an asker waiting
    ASKER_WAIT_HOLDS holds, here 0.3 s; at 30 nodes in the simulated WAN 64 of the
    trainer's 82 extra copies). The trainer sent the checkpoint once in all."""
    # a shard at 32 KiB/s: ~2 s, twice the follower's hold-back
    ckpt, manifest, origin, book, d, task = await _seeded_then_slow_holder(
        tmp_path, trainer, cfg, 32 * 1024)
    total, n = manifest.total_size, manifest.num_shards
    assert read_dir(await asyncio.wait_for(task, 60)) == read_dir(ckpt)
    assert origin.metrics["bytes_sent"] == total, (
        f"the trainer sent {origin.metrics['bytes_sent'] / total:.1f}x the checkpoint "
        f"({origin.seeding.released})")
    assert book.sources["first"].shards_ok == n
    assert d.metrics["seeded"] == n  # asked once per shard, not again


async def test_a_holder_too_slow_for_the_patience_leaves_the_shard_to_the_trainer(
        tmp_path, trainer, cfg, monkeypatch):
    """The wait for the swarm is bounded: a holder that sends, but too slowly, holds the
    follower back at most SWARM_PATIENCE_S (here 0.5 s) from the trainer's first `seeded`
    answer; then the trainer is asked again and, its asker rule met, serves."""
    monkeypatch.setattr(downloader, "SWARM_PATIENCE_S", 0.5)
    # a shard at 40 KiB/s: ~1.6 s, within the chunk timeout
    ckpt, _, origin, book, _, task = await _seeded_then_slow_holder(tmp_path, trainer, cfg,
                                                                    40 * 1024)
    assert read_dir(await asyncio.wait_for(task, 60)) == read_dir(ckpt)
    assert book.sources[trainer.peer_id].shards_ok >= 1  # the trainer served after the wait
    assert sum(origin.seeding.released.values()) >= 1


async def test_followers_carry_the_checkpoint_not_the_trainer(tmp_path, swarm):
    """Four followers and a trainer whose uploads are capped (its uplink the bottleneck,
    as on the internet): every follower verifies its copy and the trainer sends at most
    twice the checkpoint (before: about one copy per follower)."""
    n, size = 4, 1_000_000  # 16 shards of 64 KiB
    ckpt = make_checkpoint(tmp_path / "ckpt", {"model.safetensors": size})
    tnode, trainer = await swarm("trainer", "trainer")
    trainer.server.limiter = RateLimiter(512 * 1024)  # ~2 s per copy of the checkpoint
    followers = []
    for i in range(n):
        boot = tnode.listen_addrs + (followers[-1][0].listen_addrs if followers else [])
        followers.append(await swarm(f"f{i}", "inference", follow=[tnode.peer_id],
                                     bootstrap=boot))
    for node, _ in followers:  # every follower hears the others' adverts
        await wait_mesh(node, "adverts", n - 1)
    await wait_mesh(tnode, "checkpoints", n)
    m = await trainer.publish(ckpt, version=1)
    done = [await bc.done.wait(tnode.peer_id, 1, timeout=60) for _, bc in followers]
    for d in done:
        assert read_dir(d.path) == read_dir(ckpt)
    sent = trainer.server.metrics["bytes_sent"]
    assert sent <= 2 * m.total_size, f"trainer sent {sent / m.total_size:.1f}x the checkpoint"
    from_peers = sum(s["shards_ok"] for d in done for p, s in d.sources.items()
                     if p != tnode.peer_id)
    assert from_peers >= (n - 2) * m.num_shards


def test_each_copy_beyond_the_first_makes_the_next_one_wait_longer():
    """Askers whose waits run out together get one copy of the shard, not one each: the
    next extra copy waits EXTRA_BACKOFF times as long (at 30 nodes in the simulated WAN the
    trainer once gave 4 copies of one shard within 0.8 s, 6.1x the checkpoint in all)."""
    now = [0.0]
    s = Seeding("trainer", copies=1, hold_s=5.0, clock=lambda: now[0])
    key = ("trainer", 1)
    assert s.take(key, 0, "a")
    s.delivered(key, 0)
    askers = ["p0", "p1", "p2", "p3"]
    assert not any(s.take(key, 0, p) for p in askers)  # their waits start together
    base = ASKER_WAIT_HOLDS * 5.0
    for i in range(int(4 * base) + 1):  # new holders every second: never `stalled`
        now[0] = float(i)
        s.heard(f"holder{i}", _advert(1, {0}), 8)
        got = [p for p in askers if s.take(key, 0, p)]
        for p in got:
            s.delivered(key, 0)
            askers.remove(p)
        if i < base:
            assert not got
        elif i == base:
            assert got == ["p0"]  # one of the four (before: all four)
        elif i < EXTRA_BACKOFF * base:
            assert not got, f"a second copy at {i} s"
    assert got == ["p1"]  # 4x the first wait: the next one
    now[0] = MAX_ASKER_WAIT_S - 0.1  # the third waits up to MAX_ASKER_WAIT_S (not 16x)
    assert not s.take(key, 0, "p2")
    now[0] = MAX_ASKER_WAIT_S
    assert s.take(key, 0, "p2")
    assert s.released == {"stalled": 0, "waited": 3}

    stalled = Seeding("trainer", copies=1, hold_s=5.0, clock=lambda: now[0])
    now[0] = 0.0
    assert stalled.take(key, 1, "a")
    stalled.delivered(key, 1)
    assert not stalled.take(key, 1, "b")  # the hold starts
    now[0] = 5.0  # nobody carried it: one more copy
    assert stalled.take(key, 1, "b")
    stalled.delivered(key, 1)
    assert not stalled.take(key, 1, "c")  # a new hold, 4x as long
    now[0] = 5.0 + 4 * 5.0 - 0.1
    assert not stalled.take(key, 1, "c")
    now[0] = 5.0 + 4 * 5.0
    assert stalled.take(key, 1, "c")
    stalled.give_back(key, 1)  # that upload failed, no new holder: the next waits 4x, not 16x
    assert not stalled.take(key, 1, "d")
    now[0] += 4 * 5.0
    assert stalled.take(key, 1, "d")
    assert stalled.released == {"stalled": 3, "waited": 0}


async def test_followers_that_reach_no_holder_share_one_copy(tmp_path, trainer, ckpt, cfg):
    """Through the shard protocol: three followers answered `seeded` whose one known holder
    is out of reach (no route to it) wait out their asker wait together. The trainer hands
    each shard to one of them and the others take it from that one once its advert
    arrives: the trainer sends at most twice the checkpoint (before: 2.3-3.1x in 3 runs)."""
    acc = publish(trainer, ckpt, 1, cfg.shard_size)
    tstore, _ = _store(tmp_path, "trainer", acc, ckpt)
    origin = ShardServer(tstore, cfg)
    # asker wait 0.9 s, then 3.6 s: the followers ask the trainer again 1 s after its first
    # `seeded` answer (downloader.HOLD_BACK_S), then 2 s later (as 15 s, 60 s by default
    # against their 1, 3, 7, 15, 23 ... s)
    origin.seeding = Seeding(trainer.peer_id, copies=1, hold_s=0.3)
    handlers = {trainer.peer_id: origin.serve_connection}

    def transport(me: str) -> MemoryTransport:  # one per peer: the servers see who asks
        t = MemoryTransport(me)
        t.handlers = handlers
        return t

    total, n = acc.manifest.total_size, acc.manifest.num_shards
    pstore, pentry = _store(tmp_path, "unreachable", acc)
    book = SourceBook(per_source=cfg.per_source_downloads, max_corrupt=1)
    book.add(trainer.peer_id, None, origin=True)
    await Downloader(pstore, pentry, transport("unreachable"), book, cfg).run()
    assert origin.metrics["bytes_sent"] == total  # its copy; nobody can open a stream to it

    names = ["f0", "f1", "f2"]
    books: dict[str, SourceBook] = {}
    downloads: dict[str, Downloader] = {}
    have: dict[str, set[int]] = {name: set() for name in names}

    def advertise(me: str):  # what its holdings adverts do: the others and the trainer hear
        def on_shard(shard: int) -> None:
            have[me].add(shard)
            for other in names:
                if other != me:
                    books[other].add(me, {shard})
                    downloads[other].sources_changed()
            bits = bytearray((n + 7) // 8)
            for i in have[me]:
                bits[i // 8] |= 1 << (i % 8)
            origin.seeding.heard(me, ShardAdvert(policy_id=trainer.peer_id, version=1,
                                                 complete=False, have=bytes(bits)), n)
        return on_shard

    for name in names:
        store, entry = _store(tmp_path, name, acc)
        handlers[name] = ShardServer(store, cfg).serve_connection
        books[name] = SourceBook(per_source=cfg.per_source_downloads, max_corrupt=1)
        books[name].add(trainer.peer_id, None, origin=True)
        books[name].add("unreachable", None)
        downloads[name] = Downloader(store, entry, transport(name), books[name], cfg,
                                     on_shard=advertise(name))
    paths = await asyncio.wait_for(asyncio.gather(*(d.run() for d in downloads.values())), 60)
    assert all(read_dir(p) == read_dir(ckpt) for p in paths)
    sent = origin.metrics["bytes_sent"]
    assert sent <= 2 * total, (f"the trainer sent {sent / total:.1f}x the checkpoint "
                               f"({origin.seeding.released})")
    from_peers = sum(books[f].sources[p].shards_ok for f in names for p in names if p != f)
    assert from_peers >= len(names) * n - n  # the others' copies came from the one given
