"""The trainer hands each shard of its checkpoint to the swarm about once (seeding.py) and
followers take the other copies from each other: the rule alone, through the shard
protocol, and with real libp2p hosts on 127.0.0.1 whose trainer uplink is the bottleneck."""

from __future__ import annotations

import asyncio

from swarm_node.node.broadcast.downloader import Downloader
from swarm_node.node.broadcast.seeding import Seeding
from swarm_node.node.broadcast.server import RateLimiter, ShardServer
from swarm_node.node.broadcast.sources import SourceBook
from swarm_node.node.broadcast.store import ShardStore
from swarm_node.node.broadcast.transport import MemoryTransport

from tests.waiting import async_wait_until

from .conftest import make_checkpoint, publish, read_dir, wait_mesh


def test_each_shard_once_then_again_only_after_the_hold():
    now = [0.0]
    s = Seeding("trainer", copies=1, hold_s=5.0, clock=lambda: now[0])
    key = ("trainer", 1)
    assert s.take(key, 0) and not s.take(key, 0)  # one copy, then `seeded`
    assert s.take(key, 1)
    s.give_back(key, 1)  # that upload failed: the next asker gets it
    assert s.take(key, 1)
    now[0] = 4.9
    assert not s.take(key, 0)
    now[0] = 5.0  # nobody carried it within the hold: one more copy, then a new hold
    assert s.take(key, 0) and not s.take(key, 0)
    assert s.copies_of(key) == 3
    assert s.take(("someone else", 1), 0) and s.take(("someone else", 1), 0)  # not its own
    off = Seeding("trainer", copies=0, hold_s=5.0)
    assert all(off.take(key, 0) for _ in range(3))


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
