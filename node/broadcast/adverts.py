"""Holdings adverts (`shard_advert` on the `adverts` topic): what this node holds, told to
others, and who holds what, learnt from others.

Outgoing: a version is advertised as it completes, as its shards verify while it downloads
(at most every `advert_interval_s`: a round carries every shard verified since the last),
and every held version again every `readvertise_s` for late joiners.
Incoming: an advert for a followed policy makes its sender a candidate source of that
version if it is admitted (advert poisoning, below); the follower then learns of the new
source (and may pull the version's manifest from it).
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable

from ...protocol.envelope import Envelope
from ...protocol.messages import ShardAdvert
from ..p2p import Transport
from .records import VersionRecord, VersionRecords
from .sources import ProvenPeers
from .store import ShardStore, VersionEntry, advert_shards

log = logging.getLogger(__name__)

MAX_OWN_HOLDERS = 256
"""Advertisers remembered per version of this node's own policy (the swarm view's holders)."""


def _on_trial(rec: VersionRecord, proven: ProvenPeers) -> tuple[int, int]:
    """(holding a place, trials spent): of the unproven advertisers admitted for the
    version, those still on trial (not proven since, not dropped by the download in
    flight), and those that never delivered a verified shard (on trial or dropped)."""
    book = rec.book
    unproven = [p for p in rec.unproven if p not in proven]
    dropped = 0 if book is None else sum(
        1 for p in unproven if (s := book.sources.get(p)) is not None and s.dropped)
    return len(unproven) - dropped, len(unproven)


class Adverts:
    def __init__(self, node: Transport, cfg, store: ShardStore, records: VersionRecords,
                 counters: Counter, proven: ProvenPeers, *, follows: Callable[[str], bool],
                 transport=None, endpoint: Callable[[], str] = str):
        self.node, self.cfg, self.store, self.records = node, cfg, store, records
        self.counters, self.proven, self.follows = counters, proven, follows
        self.transport = transport
        self.endpoint = endpoint  # this node's bulk-plane endpoint ("": none), for adverts
        # the follower: `peer` was admitted as a source of the record's version
        self.on_source: Callable[[VersionRecord, str], None] | None = None
        # the trainer: `peer` advertised holdings of a version it published (seeding.py)
        self.on_own: Callable[[str, ShardAdvert, int], None] | None = None
        self._wake = asyncio.Event()

    # Incoming ------------------------------------------------------------------------

    async def on_advert(self, env: Envelope, from_peer: str) -> None:
        ad: ShardAdvert = env.message
        self.counters["adverts_received"] += 1
        if ad.policy_id == getattr(self.node, "peer_id", None):
            # adverts of this node's own policy: never sources; the trainer's seeding hears
            # the swarm carry its shards on (on_own), and its views count the holders
            entry = self.store.get(ad.policy_id, ad.version)
            if entry is not None and self.on_own is not None:
                self.on_own(env.sender, ad, entry.manifest.num_shards)
            self._own_holder(env.sender, ad)
            return
        if not self.follows(ad.policy_id):
            return
        rec = self.records.track((ad.policy_id, ad.version))
        if rec is None:
            return  # older than what is complete here: never fetched
        if not self._admit(rec, env.sender, ad.endpoint):
            self.counters["adverts_not_admitted"] += 1
            return
        if ad.endpoint and hasattr(self.transport, "set_endpoint"):
            self.transport.set_endpoint(env.sender, ad.endpoint)
        entry = self.store.get(*rec.key)
        n = entry.manifest.num_shards if entry is not None else len(ad.have) * 8
        rec.remember(env.sender, advert_shards(ad, n))
        if self.on_source is not None:
            self.on_source(rec, env.sender)

    def _own_holder(self, peer: str, ad: ShardAdvert) -> None:
        """`peer` holds (part of) a version this node published: remembered for the swarm
        view only (its holders, a trainer's table of who holds what), never as a source.
        Only versions still stored here, and at most MAX_OWN_HOLDERS advertisers each
        (advertisers' keys cost nothing)."""
        entry = self.store.get(ad.policy_id, ad.version)
        rec = self.records.track((ad.policy_id, ad.version)) if entry is not None else None
        if rec is None or (peer not in rec.holders and len(rec.holders) >= MAX_OWN_HOLDERS):
            return
        rec.remember(peer, advert_shards(ad, entry.manifest.num_shards))

    def _admit(self, rec: VersionRecord, peer: str, endpoint: str) -> bool:
        """Whether `peer`'s advert makes it a candidate source of the version. The trainer
        and peers we verified shards from always; others ("unproven") only up to
        `max_unproven_sources` per version at once, and at most `max_sources_per_host` of
        them per TCP endpoint host (sybil keys cost nothing, so none of this grows with
        them). An unproven peer becomes proven with its first verified shard.

        The slot of an unproven source the download dropped (its trial failed: sources.py)
        is given back, up to `unproven_refills` x `max_unproven_sources` admitted per version
        in all: each costs at most its trial. Measured first (30 nodes in the simulated WAN,
        slots kept for the version): a relay had 6 of its 8 slots taken by advertisers it
        could not open a stream to, learnt of no other holder, and sat 45 s with nothing in
        flight and 8 shards missing while most followers held them; it finished last.

        The slot of an advertiser that delivered a verified shard is given back too: it is
        a known-good source now (`ProvenPeers`), and only trials are bounded. Slots kept
        by proven sources, every book held the trainer and the first 8 advertisers, the
        same public followers for everyone (30 nodes in the simulated WAN: 7 public
        followers and a relay uploaded 450 of the 493 copies at 0.1-0.5 MiB/s a flow, while
        the other relay and 18 NAT'd peers, most of the swarm's upload, served 13). The
        refills bound counts trials that delivered nothing (on trial or dropped), so the
        advertisers that never serve still cost at most `unproven_refills` x the slots.

        An unproven advertiser that names no bulk endpoint (behind NAT: it serves over
        libp2p streams only) is admitted only while this node is connected to it: a peer
        nobody can dial would be reached through a relay circuit or not at all, its trial
        fails, and the slot is lost for the version (measured at 30 nodes: about 5 of each
        follower's 8 slots went to such peers). Refused so, it uses no slot and is admitted
        at a later advert once connected (it dials out, or a hole punch connects it)."""
        if peer in rec.holders:
            return True
        host = endpoint.rpartition(":")[0] if endpoint else ""
        if peer != rec.policy_id and peer not in self.proven:
            if not endpoint and not self._connected(peer):
                self.counters["adverts_not_connected"] += 1
                return False
            same_host = sum(1 for p in rec.unproven if rec.hosts.get(p) == host)
            cap = self.cfg.max_unproven_sources
            holding, spent = _on_trial(rec, self.proven)
            if (holding >= cap or spent >= self.cfg.unproven_refills * cap
                    or (host and same_host >= self.cfg.max_sources_per_host)):
                return False
            rec.unproven.add(peer)
        rec.hosts[peer] = host
        return True

    def _connected(self, peer: str) -> bool:
        connected = getattr(self.node, "connected_peers", None)  # test doubles may lack it
        return connected is None or peer in connected()

    # Outgoing ------------------------------------------------------------------------

    def shard_verified(self, key: tuple[str, int]) -> None:
        """Advertise the new shard at the next advert round. Not in steps of the version
        (quarters, before): a trainer hands each shard to the swarm about once
        (seeding.py), so the peer that took it must be known as its source at once, or
        every other follower waits for it; the rounds' pace (`advert_interval_s`) bounds
        what the adverts cost in gossip CPU whatever the number of shards."""
        entry, rec = self.store.get(*key), self.records.get(key)
        if entry is None or rec is None:
            return
        if len(entry.have) > rec.advertised:
            rec.advertised = len(entry.have)
            self.mark_dirty(key)

    def mark_dirty(self, key: tuple[str, int]) -> None:
        """Advertise the version at the next round (within `advert_interval_s`)."""
        rec = self.records.track(key)
        if rec is not None:
            rec.dirty = True
            self._wake.set()

    async def advertise(self, entry: VersionEntry) -> None:
        advert = entry.advert()
        if endpoint := self.endpoint():
            advert = advert.model_copy(update={"endpoint": endpoint})
        try:
            await self.node.publish("adverts", advert)
            self.counters["adverts_sent"] += 1
        except Exception as e:  # noqa: BLE001 - gossip congestion: the next round retries
            log.debug("advert failed: %r", e)
            self.mark_dirty(entry.key)

    async def run(self) -> None:
        """Advertise dirty versions (at most every `advert_interval_s`) and every held
        version every `readvertise_s`."""
        loop = asyncio.get_running_loop()
        last_all = loop.time()
        while True:
            try:
                async with asyncio.timeout(self.cfg.readvertise_s):
                    await self._wake.wait()
            except TimeoutError:
                pass
            self._wake.clear()
            everything = loop.time() - last_all >= self.cfg.readvertise_s
            if everything:
                last_all = loop.time()
            for entry in list(self.store.entries.values()):
                rec = self.records.get(entry.key)
                due = everything or (rec is not None and rec.dirty)
                if rec is not None:
                    rec.dirty = False
                if due and (entry.complete or entry.have):
                    await self.advertise(entry)
            await asyncio.sleep(self.cfg.advert_interval_s)  # the pace, not a poll
