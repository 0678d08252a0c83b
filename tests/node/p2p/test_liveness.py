"""The liveness pings close a dead peer's connections when the path died with data in
flight: its TCP send buffer full, so that every write there (a yamux GO_AWAY included)
waits for as long as the path stays dead."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading
from types import SimpleNamespace

import pytest
import trio
from libp2p.peer.id import ID
from libp2p.stream_muxer.yamux.yamux import TYPE_DATA, YAMUX_HEADER_FORMAT
from swarm_node.node.config import P2PSection
from swarm_node.node.identity import Identity
from swarm_node.node.p2p.connmgr import LIVENESS_MISSES, PING_GRACE_S, ConnectionManager
from swarm_node.node.p2p.patches.internals import transport_under
from trio.testing import MockClock

from .conftest import ignore, verdict, wait_until

SMALL_BUFFER = 4096  # bytes; the kernel doubles it and keeps its own minimum
TCP_GIVES_UP_S = 900.0  # Linux's default retransmissions (tcp_retries2 = 15) take ~15 min


def _shrink_buffers(node, peer_id: str) -> int:
    """Give `node`'s sockets to `peer_id` small send and receive buffers (so that a few
    hundred KiB unread fill them); how many sockets."""
    n = 0
    for pid, conns in list(node.context.host.get_network().connections.items()):
        if pid.to_base58() != peer_id:
            continue
        for conn in conns:
            raw = transport_under(conn.muxed_conn)
            sock = raw.stream.stream.socket  # RawConnection -> TrioTCPStream -> SocketStream
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SMALL_BUFFER)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SMALL_BUFFER)
            n += 1
    return n


def _queued_to(node, peer_id: str) -> int:
    for pid, queue in list(node.context.pubsub.peer_queues.items()):
        if pid.to_base58() == peer_id:
            return len(queue)
    return 0


async def test_a_dead_path_with_a_full_send_buffer_is_closed(make_node):
    """B's libp2p thread stops (a stopped process, or a path that drops every packet, as
    seen from A): nothing reads its socket, A's gossip to it fills both socket buffers and
    A's writes to B wait. A's pings go unanswered and A closes the connection. Before:
    py-libp2p's close writes a yamux GO_AWAY before it closes the socket, that write waited
    with the others, and A's liveness round waited on it (no later round ran): B stayed
    "connected" (in the wan benchmark's 60 s partition, ~80 s, past the heal)."""
    a = await make_node(discovery=False, liveness_interval_s=0.2, dial_timeout_s=0.5)
    b = await make_node(bootstrap=a.listen_addrs, discovery=False)
    await a.subscribe("verdicts", ignore)
    await b.subscribe("verdicts", ignore)
    await wait_until(lambda: b.peer_id in a.gossip.topic_peers("verdicts"), 20,
                     what="A to see B's subscription")

    assert await a.context.bridge.call(_async(_shrink_buffers), a, b.peer_id) >= 1
    assert await b.context.bridge.call(_async(_shrink_buffers), b, a.peer_id) >= 1
    release = threading.Event()
    b.context.bridge.call_soon(release.wait)  # B's libp2p thread stops here
    try:
        sent = 0

        async def blocked() -> bool:
            nonlocal sent
            for _ in range(20):
                await a.publish("verdicts", verdict(sent, subject=b.peer_id))
                sent += 1
            return await a.context.bridge.call(_async(_queued_to), a, b.peer_id) > 20

        await wait_until(blocked, 30, interval=0, what="A's writes to B waiting (queued)")
        await wait_until(lambda: a.metrics["connections_dead"] >= 1, 20,
                         what="A's liveness check to close the dead connection")
        assert b.peer_id not in a.connected_peers()
    finally:
        release.set()


STUCK_FRAME = 48 << 20  # bytes: more than both loopback socket buffers can hold (32 + 4 MiB)


def _write_stuck_frame(node, peer_id: str) -> None:
    """Start, in `node`'s nursery, one yamux DATA frame of STUCK_FRAME bytes to `peer_id`
    (a stream's bulk write; its window is not checked): with the peer's thread stopped the
    write can never end, and it holds the connection's write lock, as a bulk transfer in
    flight across a dead path does."""
    conn = next(c for pid, cs in node.context.host.get_network().connections.items()
                if pid.to_base58() == peer_id for c in cs).muxed_conn
    sid = next(iter(conn.streams))
    header = struct.pack(YAMUX_HEADER_FORMAT, 0, TYPE_DATA, 0, sid, STUCK_FRAME)

    async def write() -> None:
        with contextlib.suppress(Exception):  # the connection closed under it: the point
            await conn._write_frame(header + bytes(STUCK_FRAME))

    node.context.nursery.start_soon(write)


def _write_locked(node, peer_id: str) -> bool:
    return any(c.muxed_conn._write_lock.locked()
               for pid, cs in node.context.host.get_network().connections.items()
               if pid.to_base58() == peer_id for c in cs)


@pytest.mark.parametrize("how", ["disconnect", "penalty_cut"])
async def test_a_disconnect_on_a_dead_path_with_a_full_send_buffer_is_done(make_node, how):
    """Every close of ours, not only liveness's, closes a dead path's connection at once
    (closing.t_close_peer): `P2PNode.disconnect` (discovery's strays) and a penalty's cut
    (the connection manager's trims and the DHT's lookups take the same call). Liveness is
    off here (an hour). Before: py-libp2p's disconnect wrote its yamux GO_AWAY first, that
    write waited behind the one in flight, and B stayed connected until TCP gave up or B
    ran again. (A's gossip alone did not hold the write here: B's socket took it all within
    0.3 s of the freeze, hence the one big frame.)"""
    a = await make_node(discovery=False, liveness_interval_s=3600.0)
    b = await make_node(bootstrap=a.listen_addrs, discovery=False)
    await a.subscribe("verdicts", ignore)  # pubsub streams to write on
    await b.subscribe("verdicts", ignore)
    await wait_until(lambda: b.peer_id in a.gossip.topic_peers("verdicts"), 20,
                     what="A's gossip stream to B")
    release = threading.Event()
    b.context.bridge.call_soon(release.wait)  # B's libp2p thread stops here
    closing = None
    try:
        a.context.bridge.call_soon(_write_stuck_frame, a, b.peer_id)
        await wait_until(lambda: a.context.bridge.call(_async(_write_locked), a, b.peer_id),
                         20, what="A's write to B in flight")
        if how == "disconnect":
            closing = asyncio.ensure_future(a.disconnect(b.peer_id))
        else:
            assert a.penalties.penalise(b.peer_id, "window_violation")
        await wait_until(lambda: b.peer_id not in a.connected_peers(), 20,
                         what="A to close its connection to the frozen B")
        if closing is not None:
            await closing  # returned (bounded), raised nothing
        assert a.metrics["connections_dead"] == 0  # closed by the call, not by liveness
    finally:
        release.set()
        if closing is not None and not closing.done():
            closing.cancel()


def _async(fn):
    async def run(*args):
        return fn(*args)
    return run


class _DeadPathHost:
    """A host whose only peer sits behind a dead path, as py-libp2p 0.8.1 behaves there:
    `new_stream` waits for an answer that never comes and, cancelled, resets the stream in
    a shielded scope whose write waits on the full send buffer until the connection is
    closed or TCP gives up (BasicHost.new_stream's cleanup)."""

    def __init__(self, pid: ID):
        self.connections = {pid: [SimpleNamespace(muxed_conn=None)]}
        self.closed = trio.Event()
        self.disconnected: list[ID] = []

    def get_network(self):
        return SimpleNamespace(connections=self.connections)

    async def new_stream(self, pid: ID, protocols):
        try:
            await trio.sleep_forever()
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(TCP_GIVES_UP_S):
                await self.closed.wait()

    async def disconnect(self, pid: ID) -> None:
        self.disconnected.append(pid)
        self.connections.pop(pid, None)
        self.closed.set()


def test_a_ping_stuck_in_a_shielded_reset_does_not_hold_the_liveness_round():
    """A liveness round waits for its pings the ping timeout (plus a grace) at most: a
    ping stuck in py-libp2p's shielded reset is a miss, the next round counts it as a miss
    again without starting another, and the peer is closed after two. Before: the round
    waited for every ping, so one stuck ping held it, and every round after it, until TCP
    gave up (the wan run: the trainer kept its connections across a 60 s partition and past
    its heal). Trio's mock clock (no time passes but what the test's waits skip)."""
    pid = ID.from_base58(Identity.generate().peer_id)
    host = _DeadPathHost(pid)
    ctx = SimpleNamespace(cfg=P2PSection(), host=host, nursery=None)
    cm = ConnectionManager(ctx, relay=None, discovery=None)

    async def main() -> list:
        rounds = []
        async with trio.open_nursery() as nursery:
            ctx.nursery = nursery
            for _ in range(LIVENESS_MISSES):
                rounds.append((await cm._t_ping_all(), trio.current_time()))
            nursery.cancel_scope.cancel()
        return rounds

    rounds = trio.run(main, clock=MockClock(autojump_threshold=0))
    timeout = cm.ping_timeout()
    assert [dead for dead, _ in rounds] == [[], [pid.to_base58()]]
    assert rounds[-1][1] <= LIVENESS_MISSES * (timeout + PING_GRACE_S)
    assert host.disconnected == [pid]
