"""The version lifecycle (issue 28.3): what a relay keeps per version is dropped with the
version, so a relay that saw 1,000 versions holds what it held after 10.

Real parts: a trainer's Broadcaster and a relay's Broadcaster over real libp2p hosts on
127.0.0.1, real stores on disk, tiny real checkpoints; the relay learns each version as a
pulled manifest does (`accept_bytes`, the real gate and download path) and from the
adverts of three other keys (one for this version, two for versions not out yet), and
fetches each shard from the trainer over a libp2p stream. (Gossiped manifests are not used
here only because the per-peer gossip limits, rightly, cut a trainer that announces a
version every few milliseconds.)"""

from __future__ import annotations

import asyncio
import gc
import inspect
import sys
import tracemalloc
import types

import pytest
from swarm_node.node.broadcast.manifest import AcceptedManifest, build_manifest
from swarm_node.node.identity import Identity
from swarm_node.protocol.envelope import open_envelope
from swarm_node.protocol.messages import ShardAdvert

from .conftest import make_checkpoint, node_config, until

OPAQUE = (types.ModuleType, type, types.FunctionType, types.BuiltinFunctionType,
          types.FrameType, types.CodeType)
N = 1000
WINDOW = 200
BROADCAST_TYPES = ("VersionRecord", "VersionEntry", "SourceBook", "SourceStats", "Downloader",
                   "Job", "Completed", "AcceptedManifest", "CheckpointManifest", "Progress")


def reachable(root, stop: list) -> tuple[int, int]:
    """(objects, bytes) reachable from `root`, not entering `stop` (the host, the event
    loop, the transport's per-peer state: not the broadcaster's), modules, classes,
    functions or frames."""
    seen, todo, n, size = {id(o) for o in stop}, [root], 0, 0
    while todo:
        o = todo.pop()
        if id(o) in seen or isinstance(o, OPAQUE):
            continue
        seen.add(id(o))
        n, size = n + 1, size + sys.getsizeof(o)
        todo.extend(gc.get_referents(o))
    return n, size


def in_node_call(relay) -> bool:
    """Whether a task of the broadcaster is inside a call into the node (a periodic advert
    being published, say). A coroutine's locals are reachable (Python 3.11 traverses them),
    so the walk would enter the node's libp2p host through them: thousands of objects
    (a whole-suite run once counted 8,262 against 256) that the broadcaster does not hold."""
    for task in relay.tasks._tasks:
        coro = task.get_coro()
        while inspect.iscoroutine(coro):
            if "/node/p2p/" in coro.cr_code.co_filename:
                return True
            coro = coro.cr_await
    return False


async def measure(relay, stop: list) -> dict:
    """What the relay holds, once none of its tasks is inside a node call."""
    await until(lambda: not in_node_call(relay), 10, "the relay's tasks out of node calls")
    gc.collect()
    live = [type(o).__name__ for o in gc.get_objects()
            if str(type(o).__module__).startswith("swarm_node.")]
    objects, nbytes = reachable(relay, stop)
    return {"objects": objects, "bytes": nbytes, "records": len(relay.records),
            "entries": len(relay.store.entries), "ours": len(live),
            **{t: live.count(t) for t in BROADCAST_TYPES}}


def traced_since_start() -> int:
    """Bytes allocated by code in node/broadcast/ since tracemalloc started, still alive."""
    gc.collect()
    snapshot = tracemalloc.take_snapshot().filter_traces(
        [tracemalloc.Filter(True, "*/node/broadcast/*")])
    return sum(s.size for s in snapshot.statistics("filename"))


@pytest.mark.slow
async def test_a_relay_that_saw_1000_versions_holds_what_it_held_after_10(tmp_path, swarm):
    ckpt = make_checkpoint(tmp_path / "ckpt", {"model.safetensors": 4000})  # one shard
    cfg = node_config(broadcast__shard_size=4096, bulk__listen="off")
    tnode, trainer = await swarm("trainer", "trainer", cfg=cfg)
    tid = tnode.peer_id
    # advert pace within the gossip limits at this pace
    rcfg = node_config(bulk__listen="off", broadcast__advert_interval_s=0.5)
    rnode, relay = await swarm("relay", "relay", follow=[tid], bootstrap=tnode.listen_addrs,
                               cfg=rcfg)
    advertisers = [Identity.generate() for _ in range(3)]
    stop = [rnode, relay.transport, asyncio.get_running_loop()]
    try:
        for v in range(1, N + 1):
            m = build_manifest(ckpt, policy_id=tid, version=v, shard_size=4096)
            accepted = AcceptedManifest(m, tnode.identity.seal(m), tid)
            trainer.store.add_checkpoint(accepted, ckpt)
            trainer.store.prune(tid)
            for ahead, key in enumerate(advertisers):
                advert = ShardAdvert(policy_id=tid, version=v + ahead, complete=True)
                env = open_envelope(key.seal(advert), expected_type=ShardAdvert.TYPE,
                                    max_skew_s=None)
                await relay.adverts.on_advert(env, key.peer_id)
            relay.accept_bytes(accepted.envelope)
            done = await relay.done.wait(tid, v)
            assert done.fetched == m.total_size
            relay.done.got.clear()
            if v == 10:
                after_10 = await measure(relay, stop)
            if v == N - WINDOW:  # traced only over the last versions: it doubles the time
                tracemalloc.start(1)
        window = traced_since_start()
        after_1000 = await measure(relay, stop)
    finally:
        tracemalloc.stop()
    assert relay.counters()["downloads_completed"] == N
    for name in ("records", "entries", *BROADCAST_TYPES):
        assert after_1000[name] <= after_10[name] + 2, (name, after_10, after_1000)
    # a leak of one small dict entry per version would be ~100 KB here
    assert after_1000["objects"] <= after_10["objects"] + 50, (after_10, after_1000)
    assert after_1000["bytes"] <= after_10["bytes"] + 16 * 1024, (after_10, after_1000)
    assert after_1000["ours"] <= after_10["ours"] + 50, (after_10, after_1000)
    # what the broadcaster allocated over the last WINDOW versions and still holds: the
    # working set of the newest versions; one leaked 100-byte entry per version adds 20 KB
    assert window <= 24 * 1024, window
