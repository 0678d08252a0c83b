"""Attack kit for the hostile-peer tests: raw bytes below P2PNode's API, run in the
attacking node's libp2p thread. Test-only: nothing in the node imports it."""

from __future__ import annotations

import struct

from libp2p.peer.id import ID
from libp2p.pubsub.pb import rpc_pb2
from libp2p.pubsub.pubsub import PUBSUB_SIGNING_PREFIX
from libp2p.utils.varint import encode_uvarint

MESHSUB = "/meshsub/1.1.0"
_YAMUX_DATA = struct.Struct("!BBHII")  # version, type 0 = DATA, flags, stream id, length


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


async def push_ignoring_window(node, stream, total: int, chunk: int = 1 << 20) -> int:
    """Write `total` bytes on `stream` as raw yamux DATA frames, ignoring the receive
    window the peer granted. Returns the bytes written before the connection broke."""

    async def push() -> int:
        ys = stream._stream.muxed_stream
        conn, sid = ys.conn, ys.stream_id
        frame = _YAMUX_DATA.pack(0, 0, 0, sid, chunk) + bytes(chunk)
        sent = 0
        while sent < total and not conn.event_shutting_down.is_set():
            try:
                await conn._write_frame(frame)
            except Exception:  # noqa: BLE001 - the victim cut us: that is the point
                break
            sent += chunk
        return sent

    return await node.context.bridge.call(push)


def signed_rpcs(node, topic: str, payloads: list[bytes], per_rpc: int = 100,
                signer=None) -> list[bytes]:
    """Varint-framed pubsub RPCs carrying `payloads`, each message signed as GossipSub
    requires by `node`'s libp2p key, or by `signer` (an Identity: a sybil's fresh key, the
    message's origin then) while `node` only carries them."""
    pubsub = node.context.pubsub
    if signer is None:
        key, pub = node.context.host.get_private_key(), node.context.host.get_public_key()
    else:
        pair = signer.to_libp2p_keypair()
        key, pub = pair.private_key, pair.public_key
    from_id = ID.from_pubkey(pub).to_bytes()
    pub = pub.serialize()
    frames = []
    for i in range(0, len(payloads), per_rpc):
        rpc = rpc_pb2.RPC()
        for data in payloads[i:i + per_rpc]:
            msg = rpc_pb2.Message(data=data, topicIDs=[topic], from_id=from_id,
                                  seqno=pubsub._next_seqno())
            msg.signature = key.sign(PUBSUB_SIGNING_PREFIX.encode() + msg.SerializeToString())
            msg.key = pub
            rpc.publish.append(msg)
        body = rpc.SerializeToString()
        frames.append(encode_uvarint(len(body)) + body)
    return frames
