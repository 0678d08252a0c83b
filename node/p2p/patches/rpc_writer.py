"""Patch: one pubsub RPC is written whole before another starts on the same stream.

py-libp2p 0.8.1 writes an RPC with one `stream.write`, but a yamux stream's write holds its
lock per frame only (`YamuxStream.write`: a frame at most, or what the send window allows,
then the lock is released and the frame written): two writers on one stream interleave
their frames. Pubsub has several: the per-peer sending loop and the router's replays to
a new peer (`GossipSub.flush_pending_messages` as it is added, `send_recent_messages` as
it subscribes), which write to the same stream directly. An RPC larger than a frame (a
rollout batch) then arrives cut into another one, the receiver's protobuf parse fails
(`DecodeError` on /meshsub) and it drops the peer (seen in churn: peers joining while
gossip flows). And a write that fails half way (the 5-s window wait) leaves part of an RPC
on the stream, which the flush loops, catching the error, follow with more RPCs.

The replacement of `Pubsub.write_msg` (process-wide) holds a lock per stream for the
whole write, and after a write that did not complete it resets the stream and writes
nothing more to it (False, as for a closed stream): the peer sees a reset, never a cut
RPC."""

from __future__ import annotations

import logging

import trio
from libp2p.pubsub.pubsub import Pubsub

from .registry import Patch, has_signature, original, register, replace

log = logging.getLogger(__name__)

PATCH = register(Patch(
    name="atomic_rpc_writes",
    scope="process",
    targets=("libp2p.pubsub.pubsub:Pubsub.write_msg",),
    why="concurrent writers on one pubsub stream interleave yamux frames of their RPCs "
        "(DecodeError at the receiver), and a half-written RPC is followed by more",
    upstream="none filed (searched 2026-12)",
    shape=lambda: has_signature(Pubsub, "write_msg", ("self", "stream", "rpc_msg"),
                                coroutine=True),
    fingerprints={"libp2p.pubsub.pubsub:Pubsub.write_msg": "b150460d3ddd40bd"},
))


def install() -> None:
    replace(Pubsub, "write_msg", write_msg)


async def write_msg(self, stream, rpc_msg) -> bool:
    """`Pubsub.write_msg`, one RPC at a time per stream; a stream whose last write did not
    complete is reset and refused."""
    lock = getattr(stream, "_swarm_wlock", None)
    if lock is None:
        lock = stream._swarm_wlock = trio.Lock()
    async with lock:
        if getattr(stream, "_swarm_broken", False):
            return False
        done = False
        try:
            done = await original(Pubsub, "write_msg")(self, stream, rpc_msg)
            return done
        finally:
            if not done:
                stream._swarm_broken = True
                with trio.CancelScope(shield=True, deadline=trio.current_time() + 2.0):
                    try:
                        await stream.reset()
                    except Exception:  # already closed or gone
                        log.debug("reset after a failed pubsub write", exc_info=True)
