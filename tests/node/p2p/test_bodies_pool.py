"""A pull cancelled mid-ask (a push of its body landed first, or a hedge won) ends its
bulk-plane connection, which may be half read: a new one is opened at once, off the path
of the next pull from that peer (node/p2p/bodies.py). Real nodes and planes on loopback."""

from __future__ import annotations

import asyncio
import hashlib

from swarm_node.node.p2p.bodies import KIND

from .conftest import wait_until
from .test_payload_plane import meshed


async def test_a_cancelled_pull_leaves_a_pooled_connection_for_the_next(make_node):
    a, b, _ = await meshed(make_node)
    pool = a.bulk.client.kinds[KIND].pool
    await wait_until(lambda: pool.get(b.peer_id), 30, what="a's warm connection to b")
    digest = hashlib.sha256(b"on its way to b").digest()
    b.gossip._coming[digest] = asyncio.Event()  # b answers once it lands: it never does
    pull = asyncio.ensure_future(a.gossip.puller.pull(b.peer_id, digest, 1000))
    await wait_until(lambda: b.metrics["payload_bulk_holds"] == 1, 30, what="b holding")
    assert not pool.get(b.peer_id)  # the pull took the pooled connection
    pull.cancel()
    await asyncio.gather(pull, return_exceptions=True)
    # the cancelled pull's connection is gone; the next pull need not open one on its path
    await wait_until(lambda: pool.get(b.peer_id), 30, what="a new pooled connection")
    assert a.bulk.client.opened[KIND] >= 2
    b.gossip._coming.pop(digest).set()
