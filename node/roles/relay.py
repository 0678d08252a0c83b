"""Relay: mirror the checkpoints of the followed trainers and serve their shards.

A relay holds no model. It accepts a manifest only from a followed trainer (signature,
version, layout), downloads and verifies every shard like any follower, and serves what it
verified, so a trainer's upload is paid once per relay instead of once per inference peer.
"""

from __future__ import annotations

import logging

from ..broadcast.follow import trainer_choice
from .base import Role, freeze_heap
from .interfaces import BroadcastFeed, CheckpointFeed, VerifiedCheckpoint

log = logging.getLogger("swarm_node")


class RelayRole(Role):
    name = "relay"

    def __init__(self, cfg, identity, p2p, state, *, feed: CheckpointFeed | None = None):
        super().__init__(cfg, identity, p2p, state)
        self.feed = feed  # None: the broadcaster, built in start()
        self._refrozen = False  # the heap frozen again after the first mirrored checkpoint

    async def start(self) -> None:
        if self.feed is None:
            self.feed = BroadcastFeed.create(
                self.p2p, self.cfg.broadcast, self.data_dir / "broadcast",
                follow=self.cfg.node.follow, role="relay", choice=trainer_choice(self.cfg))
        self.feed.listen(self._on_complete)
        await self.feed.start()
        self.state.extra["disk"] = self.feed.disk.status()
        self.track_downloads(self.feed)
        self.watch_swarm(self.feed)
        # says so if the followed trainer never appears, like the inference role
        self.watch_followed(self.feed, self.feed.chosen)
        self.watch_heap()
        freeze_heap()

    def _on_complete(self, ckpt: VerifiedCheckpoint) -> None:
        self.state.policy_id = ckpt.policy_id
        self.state.policy_version = ckpt.version
        if ckpt.stored:  # found on disk at start: served (and advertised) again at once
            log.info("serving the stored policy %s v%d", ckpt.policy_id[-8:], ckpt.version)
            return
        self.state.count("versions_mirrored")
        log.info("mirrored policy %s v%d (%d bytes)", ckpt.policy_id[-8:], ckpt.version,
                 ckpt.size)
        if not self._refrozen:
            # A relay loads what a download needs (manifest checks, hashing, the bulk
            # plane's client) only with its first one: ~144k long-lived objects that the
            # start's freeze missed and every full collection then scanned (RESULTS
            # gc-pause: 322 ms per collection). Once, on the event loop, so ~0.3 s.
            self._refrozen = True
            freeze_heap()

    async def close(self) -> None:
        if self.feed is not None:
            await self.feed.close()
        await super().close()
