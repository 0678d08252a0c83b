"""A sybil flood on a trainer's verification (issue 30 item 4), for tests and benchmarks.

Each bogus batch passes every check before the model runs (the sender's own tasks, prompts
and seeds, proof of the exact length, text and reward consistent with its random tokens:
`attacks.bogus_round`) and is signed by a FRESH key, so no ban of an earlier key stops it.
The batches travel as raw gossip messages whose origin is that key, carried over
`connections` libp2p connections; a carrier the target cuts is replaced by a new one with
a new key of its own. What the flood costs the attacker is measured per batch
(`cpu_per_batch`: building, sealing and signing, in this thread).

Also here, on the same carriers: `VerdictFlood` (many identities, each under its own
per-origin limit, optionally churned: issue 30 item 2, fresh dials after a flood) and
`GarbageFlood` (random bytes on every protocol: item 13).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable

from libp2p.peer.id import ID
from libp2p.pubsub.pb import rpc_pb2
from libp2p.utils.varint import encode_uvarint

from ...protocol.ids import STREAM_PROTOCOLS
from ...protocol.messages import RolloutBatch, Verdict
from ..identity import Identity
from ..p2p import P2PNode

log = logging.getLogger(__name__)

MESHSUB = "/meshsub/1.1.0"
SIGNING_PREFIX = b"libp2p-pubsub:"  # what a pubsub message signature covers first (libp2p spec)
MakeBatch = Callable[[str, int], RolloutBatch]  # (sender, policy version) -> bogus batch


def gossip_frame(topic: str, data: bytes, origin: Identity, seqno: int) -> bytes:
    """One varint-framed pubsub RPC carrying `data` as a message of `origin` (signed with
    its libp2p key, as GossipSub requires), ready to write on a /meshsub stream."""
    pair = origin.to_libp2p_keypair()
    msg = rpc_pb2.Message(data=data, topicIDs=[topic],
                          from_id=ID.from_pubkey(pair.public_key).to_bytes(),
                          seqno=seqno.to_bytes(8, "big"))
    msg.signature = pair.private_key.sign(SIGNING_PREFIX + msg.SerializeToString())
    msg.key = pair.public_key.serialize()
    rpc = rpc_pb2.RPC()
    rpc.publish.append(msg)
    body = rpc.SerializeToString()
    return encode_uvarint(len(body)) + body


class _Carriers:
    """`connections` libp2p connections to `target`, each from a fresh identity and replaced
    by a new one when cut, each running `_send(node, stop)` until `stop` is set. Counters:
    `carriers` connections opened, `cut` carriers the target dropped."""

    cfg: object
    bootstrap: str
    connections: int
    carriers: int
    cut: int

    async def run(self, stop: asyncio.Event) -> None:
        await asyncio.gather(*(self._carrier(stop) for _ in range(self.connections)))

    async def _carrier(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            node = P2PNode(Identity.generate(), self.cfg)
            done = False  # the carrier ended by itself (not cut, not stopped)
            try:
                await node.start(bootstrap=[self.bootstrap], discovery=False)
                self.carriers += 1
                done = bool(await self._send(node, stop))
            except Exception as e:  # noqa: BLE001 - refused or cut: a new carrier
                log.debug("%s carrier ended: %s", type(self).__name__, e)
            finally:
                self.cut += not stop.is_set() and not done
                await node.close()
            if not stop.is_set():
                await asyncio.sleep(0.1 + random.random() * 0.1)

    async def _send(self, node: P2PNode, stop: asyncio.Event) -> bool | None:
        """Send until `stop` or a cut; True when the carrier ended by itself (it is then
        replaced, not counted as cut)."""
        raise NotImplementedError


class SybilFlood(_Carriers):
    """`run(stop)` floods `target` until `stop` is set. `accuse`: a peer each fresh key
    also accuses, after its batch, with a reject verdict of its own (issue 30 item 11: a
    verdict from a key without history must change nothing). Counters: `sent` batches,
    `accusations` verdicts, `carriers` connections opened, `cut` carriers the target
    dropped."""

    def __init__(self, cfg, bootstrap: str, target: str, make_batch: MakeBatch,
                 version: Callable[[], int], connections: int = 4,
                 interval_s: float = 0.0, accuse: str | None = None):
        self.cfg, self.bootstrap, self.target = cfg, bootstrap, target
        self.make_batch, self.version = make_batch, version
        self.connections, self.interval_s, self.accuse = connections, interval_s, accuse
        self.sent = self.accusations = self.carriers = self.cut = 0
        self.cpu_s = 0.0
        self._seqno = time.time_ns()

    @property
    def cpu_per_batch(self) -> float:
        return self.cpu_s / max(1, self.sent)

    async def _send(self, node: P2PNode, stop: asyncio.Event) -> None:
        stream = await node.open_stream(self.target, MESHSUB)
        topic = node.topic("rollouts")
        while not stop.is_set():
            t0 = time.thread_time()
            sybil = Identity.generate()
            batch = self.make_batch(sybil.peer_id, self.version())
            self._seqno += 1
            frame = gossip_frame(topic, sybil.seal(batch), sybil, self._seqno)
            self.cpu_s += time.thread_time() - t0
            await stream.write(frame)
            self.sent += 1
            if self.accuse is not None:
                self._seqno += 1
                blame = Verdict(rollout_id=random.randbytes(32), subject=self.accuse,
                                accept=False, reason="proof_bias",
                                policy_version=batch.policy_version)
                await stream.write(gossip_frame(node.topic("verdicts"), sybil.seal(blame),
                                                sybil, self._seqno))
                self.accusations += 1
            if self.target not in node.connected_peers():
                return
            await asyncio.sleep(self.interval_s)


class VerdictFlood(_Carriers):
    """`run(stop)` floods `target` with verdicts (issue 30 item 2): `connections` libp2p
    connections, each from a fresh identity that signs its own verdicts (so each stays
    under its own per-origin limit while their sum is far over the topic's) and writes
    `rate` of them per second on its /meshsub stream. With `churn_s`, each connection is
    closed after that long and replaced by a new identity's (hundreds of connections come
    and go); a carrier the target cuts is replaced too. Counters: `sent` verdicts,
    `carriers` connections opened, `cut` carriers the target dropped."""

    def __init__(self, cfg, bootstrap: str, target: str, connections: int = 20,
                 rate: float = 30.0, churn_s: float | None = None):
        self.cfg, self.bootstrap, self.target = cfg, bootstrap, target
        self.connections, self.rate, self.churn_s = connections, rate, churn_s
        self.subject = Identity.generate().peer_id  # whom the verdicts are about
        self.sent = self.carriers = self.cut = 0
        self._seqno = time.time_ns()

    async def _send(self, node: P2PNode, stop: asyncio.Event) -> bool:
        stream = await node.open_stream(self.target, MESHSUB)
        topic = node.topic("verdicts")
        loop = asyncio.get_running_loop()
        start = loop.time()
        sent = 0
        while not stop.is_set():
            if self.churn_s is not None and loop.time() - start >= self.churn_s:
                return True
            self._seqno += 1
            verdict = Verdict(rollout_id=random.randbytes(32), subject=self.subject,
                              accept=True, reason="ok", policy_version=0)
            await stream.write(gossip_frame(topic, node.identity.seal(verdict), node.identity,
                                            self._seqno))
            self.sent += 1
            sent += 1
            if self.target not in node.connected_peers():
                return False
            # the pace (verdict n leaves at n / rate s), not a wait for a condition
            await asyncio.sleep(max(0.0, start + sent / self.rate - loop.time()))
        return False


GARBAGE_PROTOCOLS = (MESHSUB, "/ipfs/id/1.0.0", "/ipfs/ping/1.0.0", "/ipfs/kad/1.0.0")
"""libp2p's protocols a node serves besides ours (protocol/ids.py STREAM_PROTOCOLS)."""


class GarbageFlood(_Carriers):
    """`run(stop)` sends garbage on every protocol `target` serves (issue 30 item 13): over
    `connections` libp2p connections, each from a fresh identity and replaced by a new one
    when cut, streams opened round robin over the protocols, each carrying 1 to `max_bytes`
    random bytes, at most one stream per `interval_s` per connection. Counters: `streams`
    opened, `refused` (the open failed), `carriers`, `cut`."""

    def __init__(self, cfg, bootstrap: str, target: str, connections: int = 4,
                 interval_s: float = 0.05, max_bytes: int = 4096, seed: int = 0):
        self.cfg, self.bootstrap, self.target = cfg, bootstrap, target
        self.connections, self.interval_s, self.max_bytes = connections, interval_s, max_bytes
        self.protocols = list(STREAM_PROTOCOLS) + list(GARBAGE_PROTOCOLS)
        self.rng = random.Random(seed)
        self.streams = self.refused = self.carriers = self.cut = 0

    async def _send(self, node: P2PNode, stop: asyncio.Event) -> None:
        i = self.rng.randrange(len(self.protocols))
        while not stop.is_set():
            if self.target not in node.connected_peers():
                return
            protocol = self.protocols[i % len(self.protocols)]
            i += 1
            data = self.rng.randbytes(self.rng.randint(1, self.max_bytes))
            try:
                stream = await node.open_stream(self.target, protocol, timeout=5.0)
                self.streams += 1
                await stream.write(data)
                await stream.close()
            except Exception as e:  # noqa: BLE001 - refused, reset or cut: next one
                self.refused += 1
                log.debug("garbage on %s: %s", protocol, e)
            await asyncio.sleep(self.interval_s)
