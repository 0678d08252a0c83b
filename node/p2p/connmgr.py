"""A bounded number of connections per node, whatever the size of the swarm.

Like libp2p's connection manager (low/high water marks): discovery dials until
`p2p.target_peers` connections are open; when more than `p2p.max_peers` are open (others
dialled us), the least useful connections are closed until `target_peers` remain. Never
closed: connections younger than `p2p.connection_grace_s`, protected peers (the trainers
this node follows, peers a role protects with `P2PNode.protect`, the relays this node
holds a slot on) and peers holding a relay slot on this node (they do not count against
the bound either: `p2p.relay.max_reservations` bounds them). The rest are ranked by how
useful they are: a gossip mesh peer (per topic) above a peer subscribed to our topics
above anyone else, a direct connection above a relayed one, an older one above a newer.

py-libp2p's own pruner (`ConnectionPruner`) never closes a connection with an open stream,
and every connection of ours carries pubsub's long-lived streams, so it never prunes here.

With connections bounded, so is everything kept per connected peer: flood publishing
(our own gossip goes to every *connected* subscriber), pubsub queues, the GossipSub mesh
(at most `mesh_degree_high` per topic), request slots.

Liveness: a connection whose path silently died (a partition, a NAT that dropped its
mapping) stays "open" for TCP's retransmission timeout, up to ~15 minutes, and discovery
does not redial a peer it counts as connected. Every `p2p.liveness_interval_s` each peer is
pinged (`/ipfs/ping/1.0.0`); after LIVENESS_MISSES pings in a row unanswered within
max(`dial_timeout_s`, `liveness_interval_s`), its connections are closed (counted
`connections_dead`), so discovery dials it afresh.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time

import trio
from libp2p.host.ping import ID as PING_PROTOCOL
from libp2p.host.ping import PING_LENGTH
from libp2p.peer.id import ID

from ..lifecycle import wait_set
from .closing import t_close_peer
from .context import HostContext
from .dialback import ip_tcp, transport_addrs
from .discovery import Discovery
from .errors import NotRunning
from .patches.internals import reservation_holders
from .relay import RelayService
from .streams import DEAD_CLOSE_S, reset_quietly

log = logging.getLogger(__name__)

TRIM_POLL_S = 5.0  # look at the count at least this often (grace periods expire)
TRIM_DEBOUNCE_S = 0.5  # after a change, wait this long for more before trimming
TRIMMED_REDIAL_S = 120.0  # discovery does not redial a peer we trimmed for this long
LIVENESS_MISSES = 2  # unanswered pings in a row before a connection is declared dead
PING_GRACE_S = 1.0  # a liveness round waits this long past the ping timeout, at most


class ConnectionManager:
    """Keeps one P2PNode's connections between `target_peers` and `max_peers`."""

    def __init__(self, ctx: HostContext, relay: RelayService, discovery: Discovery):
        self.ctx = ctx
        self.cfg = ctx.cfg
        self.relay = relay
        self.discovery = discovery
        self._protected: dict[str, set[str]] = {}
        self._since: dict[str, float] = {}  # connected peer -> when it connected
        self._wake = asyncio.Event()
        self.trimmed = 0
        self.dead = 0
        self._misses: dict[str, int] = {}
        self._pinging: set[ID] = set()  # pings started and not returned (libp2p thread)

    # Protection -----------------------------------------------------------------------

    def protect(self, peer: str, tag: str) -> None:
        """Never trim `peer` while any tag protects it."""
        self._protected.setdefault(peer, set()).add(tag)

    def unprotect(self, peer: str, tag: str) -> bool:
        """Remove one tag; True if the peer is still protected by another."""
        tags = self._protected.get(peer)
        if not tags:
            return False
        tags.discard(tag)
        if not tags:
            del self._protected[peer]
        return bool(tags)

    def protected(self) -> set[str]:
        out = set(self._protected)
        out.update(self.ctx.config.node.follow)
        out.update(self.relay.reservations)
        return out

    # Connection tracking (asyncio side) -------------------------------------------------

    def peers_changed(self, peers: set[str]) -> None:
        now = time.monotonic()
        for p in peers:
            self._since.setdefault(p, now)
        for p in [p for p in self._since if p not in peers]:
            del self._since[p]
        if len(peers) > self.cfg.max_peers:
            self._wake.set()

    async def run(self) -> None:
        while True:
            self._wake.clear()
            if await wait_set(self._wake, TRIM_POLL_S):
                await asyncio.sleep(TRIM_DEBOUNCE_S)
            if len(self._since) <= self.cfg.max_peers:
                continue
            try:
                trimmed = await self.ctx.bridge.call(
                    self._t_trim, dict(self._since), self.protected())
            except NotRunning:
                return
            except Exception as e:  # noqa: BLE001 - one bad round must not end trimming
                log.warning("connection trim failed: %s: %s", type(e).__name__, e)
                continue
            if trimmed:
                self.trimmed += len(trimmed)
                self.ctx.metrics.inc("connections_trimmed", len(trimmed))
                log.info("closed %d of %d connections (above p2p.max_peers = %d): %s",
                         len(trimmed), len(self._since), self.cfg.max_peers,
                         ", ".join(p[-8:] for p in trimmed))
                if self.discovery is not None:
                    for p in trimmed:
                        self.discovery.pause(p, TRIMMED_REDIAL_S)

    # Liveness -------------------------------------------------------------------------

    async def run_liveness(self) -> None:
        """Ping every connected peer each `p2p.liveness_interval_s`; close the connections
        of a peer that missed LIVENESS_MISSES pings in a row."""
        while True:
            await asyncio.sleep(self.cfg.liveness_interval_s)
            try:
                dead = await self.ctx.bridge.call(self._t_ping_all)
            except NotRunning:
                return
            except Exception as e:  # noqa: BLE001 - one bad round must not end the checks
                log.warning("liveness round failed: %s: %s", type(e).__name__, e)
                continue
            if dead:
                self.dead += len(dead)
                self.ctx.metrics.inc("connections_dead", len(dead))
                log.info("closed the connections of %d peer(s) that stopped answering "
                         "pings: %s", len(dead), ", ".join(p[-8:] for p in dead))

    def ping_timeout(self) -> float:
        # Generous: a ping starved of CPU on a loaded machine is not a dead path.
        return max(self.cfg.dial_timeout_s, self.cfg.liveness_interval_s)

    async def _t_ping_all(self) -> list[str]:
        host = self.ctx.host
        peers = [pid for pid, cs in list(host.get_network().connections.items()) if cs]
        answered: set[ID] = set()
        timeout = self.ping_timeout()
        # Each ping runs in the node's nursery and the round waits for it `timeout` (plus
        # a grace) at most: py-libp2p's new_stream resets a stream it could not negotiate
        # inside a shielded scope, and on a dead path with a full send buffer that reset's
        # write waits until TCP gives up (minutes), whatever our timeout. A ping still stuck
        # there from an earlier round is a miss, and no second one is started beside it.
        pending = {pid for pid in peers if pid not in self._pinging}
        back = trio.Event()

        async def ping(pid: ID) -> None:
            try:
                if await self._t_ping(pid, timeout):
                    answered.add(pid)
            finally:
                self._pinging.discard(pid)
                pending.discard(pid)
                if not pending:
                    back.set()

        nursery = self.ctx.nursery
        for pid in list(pending):
            self._pinging.add(pid)
            if nursery is not None:
                nursery.start_soon(ping, pid)
            else:  # not started or closing: nothing to ping from
                self._pinging.discard(pid)
                pending.discard(pid)
        if not pending:
            back.set()
        with trio.move_on_after(timeout + PING_GRACE_S):
            await back.wait()
        dead = []
        now_connected = {pid.to_base58() for pid in peers}
        for p in list(self._misses):
            if p not in now_connected:
                del self._misses[p]
        for pid in peers:
            p = pid.to_base58()
            if pid in answered:
                self._misses.pop(p, None)
                continue
            self._misses[p] = self._misses.get(p, 0) + 1
            if self._misses[p] >= LIVENESS_MISSES:
                del self._misses[p]
                dead.append(pid)
        # transports first, each bounded (closing.py): py-libp2p's close alone waited on a
        # dead path until TCP gave up (the wan partition: closed ~80 s in, past the heal)
        async with trio.open_nursery() as nursery:
            for pid in dead:
                nursery.start_soon(t_close_peer, self.ctx.host, pid, DEAD_CLOSE_S,
                                   "liveness: pings unanswered")
        return [pid.to_base58() for pid in dead]

    async def _t_ping(self, pid: ID, timeout: float) -> bool:
        """One ping of `pid` within `timeout`: whether it answered."""
        host = self.ctx.host
        stream = None
        try:
            with trio.move_on_after(timeout):
                stream = await host.new_stream(pid, [PING_PROTOCOL])
                payload = os.urandom(PING_LENGTH)
                await stream.write(payload)
                got = b""
                while len(got) < PING_LENGTH:
                    chunk = await stream.read(PING_LENGTH - len(got))
                    if not chunk:
                        break
                    got += chunk
                return got == payload
        except Exception as e:  # noqa: BLE001 - a failed ping is a miss
            log.debug("ping of %s: %s", pid, e)
        finally:
            if stream is not None:  # a reset writes a frame: on a dead path, bounded
                await reset_quietly(stream)
        return False

    # Trimming (trio side) ---------------------------------------------------------------

    async def _t_trim(self, since: dict[str, float], protected: set[str]) -> list[str]:
        ctx = self.ctx
        conns = ctx.host.get_network().connections
        peers = {pid.to_base58(): pid for pid, cs in list(conns.items()) if cs}
        holders = self._t_slot_holders()
        counted = [p for p in peers if p not in holders]
        excess = len(counted) - self.cfg.target_peers
        if len(counted) <= self.cfg.max_peers or excess <= 0:
            return []
        now = time.monotonic()
        grace = self.cfg.connection_grace_s
        candidates = [p for p in counted if p not in protected
                      and now - since.get(p, now) >= grace]
        mesh, subscribed = self._t_gossip_roles()
        candidates.sort(key=lambda p: (mesh.get(p, 0), subscribed.get(p, 0),
                                       self._t_is_direct(peers[p]), -since.get(p, now)))
        # A mesh peer goes only if closing every other connection (those still in their
        # grace period too, later) could not reach the target: otherwise a burst of new
        # connections (a DHT lookup dials up to 20 peers) would cost us the mesh.
        others = sum(1 for p in counted if not mesh.get(p))
        mesh_quota = max(0, excess - others)
        victims = []
        for p in candidates:
            if len(victims) >= excess:
                break
            if mesh.get(p):
                if mesh_quota <= 0:
                    continue
                mesh_quota -= 1
            victims.append(p)
        async with trio.open_nursery() as nursery:  # each bounded: one may sit on a dead path
            for p in victims:
                nursery.start_soon(t_close_peer, ctx.host, peers[p], DEAD_CLOSE_S,
                                   "trimmed above max_peers")
        return victims

    def _t_slot_holders(self) -> set[str]:
        p = self.relay.protocol
        if p is None or not self.relay.hop:
            return set()
        return {pid.to_base58() for pid in reservation_holders(p.resource_manager)}

    def _t_gossip_roles(self) -> tuple[dict[str, int], dict[str, int]]:
        mesh: dict[str, int] = {}
        subscribed: dict[str, int] = {}
        router, pubsub = self.ctx.router, self.ctx.pubsub
        for members in list(getattr(router, "mesh", {}).values()):
            for pid in list(members):
                mesh[pid.to_base58()] = mesh.get(pid.to_base58(), 0) + 1
        for members in list(getattr(pubsub, "peer_topics", {}).values()):
            for pid in list(members):
                subscribed[pid.to_base58()] = subscribed.get(pid.to_base58(), 0) + 1
        return mesh, subscribed

    def _t_is_direct(self, pid: ID) -> bool:
        conns = self.ctx.host.get_network().connections.get(pid, []) or []
        return any(ip_tcp(str(a)) is not None for c in conns for a in transport_addrs(c))
