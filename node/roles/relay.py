"""Relay: mirror the checkpoints of the followed trainers and serve their shards.

A relay holds no model. It accepts a manifest only from a followed trainer (signature,
version, layout), downloads and verifies every shard like any follower, and serves what it
verified, so a trainer's upload is paid once per relay instead of once per inference peer.
"""

from __future__ import annotations

import logging

from ..broadcast.follow import trainer_choice
from ..broadcast.service import Broadcaster
from .base import Role

log = logging.getLogger("swarm_node")


class RelayRole(Role):
    name = "relay"

    def __init__(self, cfg, identity, p2p, state):
        super().__init__(cfg, identity, p2p, state)
        self.broadcaster = None

    async def start(self) -> None:
        self.broadcaster = Broadcaster(self.p2p, self.cfg.broadcast, self.data_dir / "broadcast",
                                       follow=self.cfg.node.follow, role="relay",
                                       on_complete=self._on_complete,
                                       choice=trainer_choice(self.cfg))
        await self.broadcaster.start()
        self.state.extra["disk"] = self.broadcaster.disk.status()
        self.track_downloads(self.broadcaster)

    def _on_complete(self, manifest, path) -> None:
        self.state.policy_id = manifest.policy_id
        self.state.policy_version = manifest.version
        self.state.count("versions_mirrored")
        log.info("mirrored policy %s v%d (%d bytes)", manifest.policy_id[-8:], manifest.version,
                 manifest.total_size)

    async def close(self) -> None:
        if self.broadcaster is not None:
            await self.broadcaster.close()
        await super().close()
