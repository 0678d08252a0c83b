"""The trainer's seed hold follows the swarm, not a timer (seeding.py): real libp2p hosts
on 127.0.0.1, real adverts over gossip. It hands a shard out again only once an asker went
unanswered for `seed_hold_s` with no new holder advertised meanwhile; holders that serve
keep it held, a holder that stalls releases it and nothing is lost."""

from __future__ import annotations

from swarm_node.node.broadcast.server import RateLimiter

from .conftest import make_checkpoint, node_config, read_dir, until, wait_mesh


async def test_no_copy_again_while_holders_serve_it(tmp_path, swarm):
    """Long after the trainer's first copies (its hold's clock moved on 1000 s: the old
    timer would hand the next asker a copy), followers that ask it get `seeded` and take
    the shards from the holder; their adverts as new holders end the trainer's wait, so
    an ask much later starts a new hold instead of releasing a copy."""
    ckpt = make_checkpoint(tmp_path / "ckpt", {"model.safetensors": 1_000_000})  # 16 shards
    cfg = node_config(broadcast__seed_hold_s=2)
    tnode, trainer = await swarm("trainer", "trainer", cfg=cfg)
    now = [0.0]
    seeding = trainer.server.seeding
    seeding.clock = lambda: now[0]
    anode, a = await swarm("a", "inference", follow=[tnode.peer_id],
                           bootstrap=tnode.listen_addrs, cfg=cfg)
    await wait_mesh(tnode, "checkpoints", 1)
    m = await trainer.publish(ckpt, version=1)
    await a.done.wait(tnode.peer_id, 1, timeout=60)
    key = (tnode.peer_id, 1)
    assert trainer.server.served_to == {anode.peer_id: m.total_size}

    now[0] = 1000.0
    _bnode, b = await swarm("b", "inference", follow=[tnode.peer_id],
                           bootstrap=tnode.listen_addrs + anode.listen_addrs, cfg=cfg)
    done = await b.done.wait(tnode.peer_id, 1, timeout=60)
    assert read_dir(done.path) == read_dir(ckpt)
    assert trainer.server.served_to == {anode.peer_id: m.total_size}  # nothing again
    asked = trainer.server.metrics["error_seeded"]
    assert asked >= 1, "b never asked the trainer: the hold was not exercised"
    # b's adverts name it as a holder the trainer did not give a copy: no ask waits
    await until(lambda: seeding.unanswered(key) == 0, 30, "b's adverts heard")

    now[0] = 2000.0  # a hold after b's asks: a release if they still counted
    _cnode, c = await swarm("c", "inference", follow=[tnode.peer_id],
                           bootstrap=tnode.listen_addrs + anode.listen_addrs, cfg=cfg)
    done = await c.done.wait(tnode.peer_id, 1, timeout=60)
    assert read_dir(done.path) == read_dir(ckpt)
    assert trainer.server.served_to == {anode.peer_id: m.total_size}
    assert seeding.released == {"stalled": 0, "waited": 0}


async def test_a_holder_that_stalls_releases_the_shard(tmp_path, swarm):
    """The only holder takes requests and sends nothing: the follower's transfers from it
    time out, its asks to the trainer go unanswered by any new holder, and `seed_hold_s`
    after the first of them the trainer serves it. Its copy verifies."""
    ckpt = make_checkpoint(tmp_path / "ckpt", {"model.safetensors": 300_000})  # 5 shards
    cfg = node_config(broadcast__seed_hold_s=1, broadcast__chunk_timeout_s=1,
                      broadcast__request_timeout_s=2)
    tnode, trainer = await swarm("trainer", "trainer", cfg=cfg)
    anode, a = await swarm("a", "inference", follow=[tnode.peer_id],
                           bootstrap=tnode.listen_addrs, cfg=cfg)
    await wait_mesh(tnode, "checkpoints", 1)
    m = await trainer.publish(ckpt, version=1)
    await a.done.wait(tnode.peer_id, 1, timeout=60)
    a.server.limiter = RateLimiter(1.0)  # a header, then nothing: a stalled holder
    cnode, c = await swarm("c", "inference", follow=[tnode.peer_id],
                           bootstrap=tnode.listen_addrs + anode.listen_addrs, cfg=cfg)
    done = await c.done.wait(tnode.peer_id, 1, timeout=60)
    assert read_dir(done.path) == read_dir(ckpt)
    assert trainer.server.served_to[cnode.peer_id] == m.total_size  # its copy, from the trainer
    released = trainer.server.seeding.released
    assert released["stalled"] + released["waited"] == m.num_shards, released
