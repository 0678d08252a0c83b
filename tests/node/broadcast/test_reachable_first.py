"""The trainer's first copies go to followers that others can reach, and a follower behind
NAT takes them from those (sources.NAT_HEAD_START_S); advertisers behind NAT are admitted
as sources only over a connection this node has (adverts.py). Real libp2p hosts on
127.0.0.1; "behind NAT" is the node's own reachability verdict, pinned (conftest)."""

from __future__ import annotations

from collections import Counter

from swarm_node.node.broadcast.adverts import Adverts
from swarm_node.node.broadcast.records import VersionRecords
from swarm_node.node.broadcast.sources import ProvenPeers, SourceBook
from swarm_node.node.broadcast.store import ShardStore

from .conftest import make_checkpoint, node_config, read_dir, wait_mesh


def test_the_trainer_waits_out_the_head_start_other_holders_do_not():
    now = [10.0]
    book = SourceBook(per_source=4, max_corrupt=1, clock=lambda: now[0])
    book.add("trainer", None, origin=True)
    book.origin_not_before = 11.0
    assert book.pick(0) is None  # only the trainer holds it: wait, not ask
    assert book.next_ready() == 11.0  # the workers wake when the head start ends
    book.add("public", {1}, proven=True)
    assert book.pick(1) == "public"  # a holder other than the trainer: at once
    now[0] = 11.0
    assert book.pick(0) == "trainer" and book.next_ready() is None


class _Node:
    """The part of a node `Adverts._admit` reads: who is connected."""

    def __init__(self):
        self.connected: set[str] = set()

    def connected_peers(self) -> list[str]:
        return sorted(self.connected)


def test_an_advertiser_behind_nat_is_admitted_once_connected(tmp_path):
    node = _Node()
    store = ShardStore(tmp_path / "s")
    records = VersionRecords(store)
    counters: Counter[str] = Counter()
    cfg = node_config().broadcast.model_copy(update={"max_unproven_sources": 1})
    adverts = Adverts(node, cfg, store, records, counters, ProvenPeers(),
                      follows=lambda p: True)
    rec = records.track(("trainer", 1))
    assert not adverts._admit(rec, "natted", "")  # no endpoint, no connection
    assert counters["adverts_not_connected"] == 1 and not rec.unproven  # no slot used
    node.connected.add("natted")  # it dialled us (or a hole punch connected it)
    assert adverts._admit(rec, "natted", "")
    assert not adverts._admit(rec, "other", "10.0.0.9:4002")  # the one slot is taken
    assert adverts._admit(rec, "trainer", "")  # the trainer always


async def test_the_trainers_first_copies_go_to_the_reachable_follower(tmp_path, swarm):
    """A public follower and two behind NAT: the trainer (each shard once, a hold longer
    than the test) uploads every shard to the public one only, and the NAT'd followers
    take their copies from it. Before the head start, they asked the trainer at the same
    moment and took about two thirds of its first copies."""
    ckpt = make_checkpoint(tmp_path / "ckpt", {"model.safetensors": 1_000_000})  # 16 shards
    cfg = node_config(broadcast__seed_hold_s=600)
    tnode, trainer = await swarm("trainer", "trainer", cfg=cfg)
    pnode, public = await swarm("public", "inference", follow=[tnode.peer_id],
                                bootstrap=tnode.listen_addrs, cfg=cfg)
    natted = [await swarm(f"nat{i}", "inference", follow=[tnode.peer_id], natted=True,
                          bootstrap=tnode.listen_addrs + pnode.listen_addrs, cfg=cfg)
              for i in range(2)]
    for node, _ in natted:
        await wait_mesh(node, "adverts", 2)
    await wait_mesh(tnode, "checkpoints", 3)
    m = await trainer.publish(ckpt, version=1)
    first = await public.done.wait(tnode.peer_id, 1, timeout=60)
    assert read_dir(first.path) == read_dir(ckpt)
    for node, bc in natted:
        done = await bc.done.wait(tnode.peer_id, 1, timeout=60)
        assert read_dir(done.path) == read_dir(ckpt)
        assert node.reachability.verdict == "unreachable"  # still behind NAT
        assert not done.sources.get(tnode.peer_id, {}).get("shards_ok")
    served = trainer.server.served_to
    assert set(served) == {pnode.peer_id}, {p[-6:]: n for p, n in served.items()}
    assert served[pnode.peer_id] == m.total_size  # the checkpoint once


async def test_nothing_is_lost_when_the_reachable_holder_is_gone(tmp_path, swarm):
    """The public follower that took the trainer's copies leaves before a follower behind
    NAT joins: that follower waits out its head start and the trainer's hold (`seeded`
    meanwhile), then gets its copy from the trainer."""
    ckpt = make_checkpoint(tmp_path / "ckpt", {"model.safetensors": 300_000})  # 5 shards
    cfg = node_config(broadcast__seed_hold_s=2)
    tnode, trainer = await swarm("trainer", "trainer", cfg=cfg)
    pnode, public = await swarm("public", "inference", follow=[tnode.peer_id],
                                bootstrap=tnode.listen_addrs, cfg=cfg)
    await wait_mesh(tnode, "checkpoints", 1)
    m = await trainer.publish(ckpt, version=1)
    await public.done.wait(tnode.peer_id, 1, timeout=60)
    await public.close()
    await pnode.close()
    nnode, late = await swarm("nat", "inference", follow=[tnode.peer_id], natted=True,
                              bootstrap=tnode.listen_addrs, cfg=cfg)
    done = await late.done.wait(tnode.peer_id, 1, timeout=60)
    assert read_dir(done.path) == read_dir(ckpt)
    assert trainer.server.served_to[nnode.peer_id] == m.total_size  # its copy again
