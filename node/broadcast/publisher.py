"""The trainer side of the broadcaster: hash, store and announce this node's own
checkpoints (NODE_SPEC 7.1)."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from pathlib import Path

from ...protocol.messages import CheckpointManifest, SwarmSettings
from ..p2p import Transport
from .adverts import Adverts
from .errors import BroadcastError
from .manifest import AcceptedManifest, build_manifest, checkpoint_files
from .records import VersionRecords
from .store import ShardStore

log = logging.getLogger(__name__)


class Publisher:
    def __init__(self, node: Transport, cfg, store: ShardStore, records: VersionRecords,
                 adverts: Adverts, counters: Counter, settings: SwarmSettings | None = None):
        self.node, self.cfg, self.store, self.records = node, cfg, store, records
        self.adverts, self.counters = adverts, counters
        self.settings = settings  # signed into each manifest

    async def publish(self, ckpt_dir: Path, version: int, parent_version: int = -1,
                      shard_size: int | None = None,
                      hash_algo: str | None = None) -> CheckpointManifest:
        """Hash, store and announce a new checkpoint of this node's own policy
        (`hash_algo`, default `broadcast.hash_algo`: NODE_SPEC 7.1)."""
        shard_size = shard_size or self.cfg.shard_size
        total = sum(f.size for f in checkpoint_files(ckpt_dir))
        if -(-total // shard_size) > self.cfg.max_shards:
            raise BroadcastError(
                f"{ckpt_dir}: {total} bytes in {shard_size}-byte shards is "
                f"{-(-total // shard_size)} shards, more than broadcast.max_shards "
                f"({self.cfg.max_shards}) that followers accept: raise broadcast.shard_size")
        m = await asyncio.to_thread(
            build_manifest, ckpt_dir, policy_id=self.node.peer_id, version=version,
            parent_version=parent_version, shard_size=shard_size, settings=self.settings,
            hash_algo=hash_algo or self.cfg.hash_algo)
        accepted = AcceptedManifest(m, self.node.identity.seal(m), self.node.peer_id)
        entry = await asyncio.to_thread(self.store.add_checkpoint, accepted, ckpt_dir)
        await asyncio.to_thread(self.store.prune, m.policy_id)
        self.records.settle(m.policy_id)
        await self.adverts.advertise(entry)  # first, so followers know our endpoint, if any
        await self.node.publish("checkpoints", m)
        self.counters["versions_published"] += 1
        log.info("published policy %s v%d: %d bytes in %d shards", m.policy_id[-8:], version,
                 m.total_size, m.num_shards)
        return m
