"""The broadcaster of one node, over a `P2PNode`: the parts that publish (publisher.py, a
trainer's own checkpoints), follow (follower.py: the manifest gate, the trainer choice,
downloads) and advertise (adverts.py), around one store (store.py) whose versions carry one
record each (records.py), dropped with the version.

Gossip: manifests on the `checkpoints` topic (the trainer's own signed envelope), holdings
on the `adverts` topic (ShardAdvert). Streams: shards on SHARD_PROTOCOL (and the node's bulk
plane, node/p2p/bulk); the signed manifest envelope of a version on MANIFEST_PROTOCOL (request/response),
so a peer that missed the gossip learns a version from anyone's advert; the trainers this
node follows on FOLLOWS_PROTOCOL (a newcomer's choice, follow.py). Roles: `trainer`
publishes; `inference` and `relay` follow (the relay mirrors and serves, keeping
`relay_keep_versions`); every node serves what it verified.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from ...protocol.errors import ProtocolError
from ...protocol.ids import FOLLOWS_PROTOCOL, MANIFEST_PROTOCOL, SHARD_PROTOCOL
from ...protocol.messages import CheckpointManifest, ShardRequest, SwarmSettings
from ..lifecycle import TaskOwner
from ..p2p import Transport
from .adverts import Adverts
from .errors import BroadcastError
from .follow import TrainerChoice, encode_follows
from .follower import Completed, Follower, OnComplete
from .manifest import AcceptedManifest
from .publisher import Publisher
from .records import VersionRecords
from .seeding import Seeding
from .server import ShardServer
from .sources import ProvenPeers
from .store import ShardStore
from .transport import P2PTransport, RoutingTransport

log = logging.getLogger(__name__)

CLOSE_TIMEOUT_S = 10.0
__all__ = ["Broadcaster", "Completed", "OnComplete"]


class Broadcaster:
    def __init__(self, node: Transport, cfg, store_root: Path, *, follow: list[str] | None = None,
                 role: str = "inference", on_complete: OnComplete | None = None,
                 transport=None, interactive: bool | None = None,
                 choice: TrainerChoice | None = None, settings: SwarmSettings | None = None,
                 settings_check=None):
        self.node, self.cfg, self.role = node, cfg, role
        keep = cfg.relay_keep_versions if role == "relay" else cfg.keep_versions
        self.store = ShardStore(store_root, keep_versions=keep)
        self.records = VersionRecords(self.store)
        self.counts: Counter[str] = Counter()  # for the life of the node (counters())
        # every background task: adverts, downloads, pulls, the trainer choice
        self.tasks = TaskOwner("broadcast", on_failure=self._task_failed)
        self.proven = ProvenPeers()  # peers we verified shards from
        self.server = ShardServer(self.store, cfg)
        if role == "trainer":  # each shard of its own checkpoints goes out about once
            self.server.seeding = Seeding(node.peer_id, cfg.seed_copies, cfg.seed_hold_s)
        self.transport = transport or RoutingTransport(P2PTransport(node), bulk=node.bulk)
        self.adverts = Adverts(node, cfg, self.store, self.records, self.counts,
                               self.proven, follows=self._follows, transport=self.transport,
                               endpoint=lambda: self.endpoint)
        self.follower = Follower(node, cfg, self.store, self.records, self.counts,
                                 self.proven, self.transport, tasks=self.tasks,
                                 follow=list(follow or []),
                                 choice=choice, settings_check=settings_check,
                                 interactive=interactive)
        self.follower.on_complete = on_complete
        if self.server.seeding is not None:  # holders' adverts say the swarm carries a shard
            self.adverts.on_own = self.server.seeding.heard
        # called once the store is loaded, before unfinished downloads resume: a feed hands
        # the stored versions over here (roles/interfaces.py BroadcastFeed)
        self.on_loaded: Callable[[], None] | None = None
        self.follower.on_shard = self.adverts.shard_verified
        self.follower.on_done = self.adverts.mark_dirty
        self.adverts.on_source = self.follower.on_source
        self.publisher = Publisher(node, cfg, self.store, self.records, self.adverts,
                                   self.counts, settings)

    def _task_failed(self, name: str, error: BaseException) -> None:
        self.counts["task_failures"] += 1

    def _follows(self, policy_id: str) -> bool:
        return self.follower.gate.follows(policy_id)

    @property
    def gate(self):
        return self.follower.gate

    @property
    def choice(self) -> TrainerChoice | None:
        return self.follower.choice

    @property
    def disk(self):
        return self.follower.disk

    @property
    def endpoint(self) -> str:
        """Our bulk-plane endpoint for adverts ("" if none to name: node/p2p/bulk)."""
        bulk = self.node.bulk
        return bulk.endpoint if bulk is not None else ""

    @property
    def on_complete(self) -> OnComplete | None:
        return self.follower.on_complete

    @on_complete.setter
    def on_complete(self, fn: OnComplete | None) -> None:
        self.follower.on_complete = fn

    # Lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        for entry in await asyncio.to_thread(self.store.load, self.gate.problem):
            self.adverts.mark_dirty(entry.key)
        if self.on_loaded is not None:
            self.on_loaded()
        # shard after shard on one stream while the client keeps sending requests
        self.node.set_stream_handler(SHARD_PROTOCOL, self.server.serve_connection)
        bulk = self.node.bulk
        if bulk is not None:  # the node's bulk plane (TLS beside libp2p) serves shards too
            bulk.register("shard", self.server.serve_connection)
            bulk.add_known(lambda peer: peer in self.proven or self.gate.follows(peer))
        self.node.set_request_handler(MANIFEST_PROTOCOL, self._serve_manifest)
        self.node.set_request_handler(FOLLOWS_PROTOCOL, self._serve_follows)
        self.node.set_followed(self.gate.follows)  # its publication rate is never throttled
        await self.node.subscribe("checkpoints", self.follower.on_manifest)
        await self.node.subscribe("adverts", self.adverts.on_advert)
        self.tasks.spawn(self.adverts.run(), "adverts")
        if self.choice is not None and self.choice.deciding:
            self.tasks.spawn(self.follower.choose(), "trainer choice")
        self.follower.resume()

    async def close(self) -> None:
        if isinstance(self.transport, RoutingTransport):
            self.transport.close()  # idle bulk-plane connections and pooled streams
        await self.tasks.close(CLOSE_TIMEOUT_S)  # downloads, pulls, adverts, the choice
        if isinstance(self.transport, RoutingTransport):  # the closes of pooled streams
            await self.transport.tasks.close(CLOSE_TIMEOUT_S, cancel=False)

    # What the node does ---------------------------------------------------------------

    async def publish(self, ckpt_dir: Path, version: int, parent_version: int = -1,
                      shard_size: int | None = None,
                      hash_algo: str | None = None) -> CheckpointManifest:
        """See Publisher.publish."""
        return await self.publisher.publish(ckpt_dir, version, parent_version, shard_size,
                                            hash_algo)

    def accept_bytes(self, data: bytes) -> AcceptedManifest:
        """See Follower.accept_bytes."""
        return self.follower.accept_bytes(data)

    def path(self, policy_id: str, version: int) -> Path | None:
        """The verified directory of (policy, version) while the store holds it."""
        entry = self.store.get(policy_id, version)
        return entry.checkpoint_dir if entry is not None and entry.complete else None

    def counters(self) -> dict[str, int]:
        """Everything this node's broadcast did, counted since it started: downloads
        (finished and in flight), manifests by outcome, adverts, shards served."""
        out = Counter(self.counts)
        out.update(self.follower.live_counters())
        for reason, n in self.gate.rejected.items():
            out[f"manifests_rejected_{reason}"] += n
        for name, n in self.server.metrics.items():
            out[f"served_{name}"] += n
        if self.server.seeding is not None:  # copies beyond a shard's first, by reason
            for why, n in self.server.seeding.released.items():
                out[f"seed_released_{why}"] += n
        if isinstance(self.transport, RoutingTransport):  # shard streams by path, reuse
            for path, n in self.transport.opened.items():
                out[f"streams_{path}"] += n
        return dict(out)

    # Served to peers ------------------------------------------------------------------

    async def _serve_manifest(self, peer: str, body: bytes) -> bytes:
        try:
            req = ShardRequest.decode(body)
        except ProtocolError as e:
            raise BroadcastError(f"bad manifest request: {e.reason}") from None
        entry = self.store.get(req.policy_id, req.version)
        if entry is None:
            raise LookupError("version not held here")
        return entry.envelope

    async def _serve_follows(self, peer: str, body: bytes) -> bytes:
        """The trainers this node follows (a trainer names itself), for a newcomer that
        bootstraps through it (follow.py)."""
        if self.role == "trainer":
            return encode_follows([self.node.peer_id])
        return encode_follows(sorted(self.gate.follow))
