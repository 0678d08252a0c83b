"""Kad-DHT discovery: peers of this swarm, and who provides a key (a checkpoint version).

py-libp2p 0.8.1's `KadDHT` (protocol `/ipfs/kad/1.0.0`: its `protocol_prefix` argument is
not used, so the ID cannot be ours; the DHT only ever runs over connections to peers of
our own swarm, which discovery made). Provider records only; the value store is off.

- Keys are sha2-256 multihashes of a namespaced name: `dht_key("swarm", swarm_id)` is
  the swarm's rendezvous key, `dht_key("checkpoint", ...)` whatever the broadcast layer
  names. Publicly reachable trainers and relays provide the swarm key (`anchors_swarm`:
  long-lived, and few; NAT'd nodes never). Everyone else is found through peer exchange,
  where relayed addresses travel too. Public relays (hop service on) also provide
  `dht_key("relay", swarm_id)`: a NAT'd node short of relay slots among its connections
  looks them up there (relay.py).
- The routing table is seeded from every connection (py-libp2p adds a peer only when it
  opens a DHT stream to us), with the per-subnet cap off (a LAN or loopback swarm shares
  one /24).
- What a provider record carries (`provide`): a public node (or one whose verdict is not in
  yet) its listen addresses, as py-libp2p sends them; a node behind NAT its relayed
  (`/p2p-circuit`) addresses only, sent by `_t_provide_relayed` (py-libp2p's provider store
  would send the private listen addresses nobody outside the NAT can dial); behind NAT
  without a relay slot, nothing (`provide` returns False: the record would only cost the
  finders failed dials).
- A node is a DHT server while it is (or may be) publicly reachable, a client behind NAT.
- `find_providers` walks the network itself: py-libp2p's returns its local records only
  whenever it holds any, and a provider always holds its own.
- A lookup (a provide, a find) dials the peers it asks; once it is done, the connections
  its own dials opened are closed again if this node holds `target_peers` without them
  (`_t_close_transient`). Only those: a connection that anything else opened meanwhile (an
  inbound one, a discovery dial, a hole punch) is not the lookup's to close. Which
  connections a lookup's dials opened: the "connected" notifications raised inside its
  trio tasks (py-libp2p announces an outbound connection from the task that dialled it,
  and trio tasks inherit the context of the task that started them; `_LOOKUP_DIALS`).

Methods named `_t_*` run in the libp2p (trio) thread.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from contextvars import ContextVar

import trio
from libp2p.kad_dht import DHTMode, KadDHT
from libp2p.kad_dht.common import ALPHA, PROTOCOL_ID, QUERY_TIMEOUT
from libp2p.kad_dht.pb.kademlia_pb2 import Message
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo
from libp2p.utils.varint import encode_varint_prefixed
from multiaddr import Multiaddr

from ..lifecycle import wait_set
from .closing import t_close_peer
from .context import ConnectionNotifee, HostContext
from .discovery import dial_order
from .errors import NotRunning, P2PError
from .patches.internals import providers_from_peer
from .streams import DEAD_CLOSE_S, close_quietly

log = logging.getLogger(__name__)

MAX_QUERIED = 20  # peers asked per find_providers walk
REPROVIDE_S = 3600.0  # a public anchor re-announces its swarm key this often
ANCHOR_ROLES = ("trainer", "relay")  # the roles that announce the swarm key when public
SHA2_256 = b"\x12\x20"  # multihash prefix: sha2-256, 32 bytes

# The connections that the dials of the lookup running in this trio task (and in the tasks
# it started) opened; None outside a lookup. Filled by _LookupDials.
_LOOKUP_DIALS: ContextVar[list | None] = ContextVar("dht_lookup_dials", default=None)


def dht_key(namespace: str, name: str | bytes) -> bytes:
    """The DHT key of `name` in `namespace` (a sha2-256 multihash)."""
    raw = name.encode() if isinstance(name, str) else bytes(name)
    return SHA2_256 + hashlib.sha256(f"swarm-node/{namespace}/".encode() + raw).digest()


class DHTService:
    """The Kad-DHT of one P2PNode (`p2p.dht`)."""

    def __init__(self, ctx: HostContext, known_addrs: Callable[[str], list[str]]):
        self.ctx = ctx
        self.known_addrs = known_addrs  # what this node learned otherwise (discovery)
        self.enabled = ctx.cfg.dht
        self.dht: KadDHT | None = None
        self.swarm_key = dht_key("swarm", ctx.swarm_id)
        self.relay_key = dht_key("relay", ctx.swarm_id)
        self._wake = asyncio.Event()
        self._t_seen: set[ID] = set()

    def t_service(self, host) -> KadDHT | None:
        if not self.enabled:
            return None
        self.dht = KadDHT(host, DHTMode.SERVER, enable_values=False, max_peers_per_subnet=0)
        host.get_network().register_notifee(_LookupDials())
        return self.dht

    def t_connections_changed(self, nursery, connected: list[ID]) -> None:
        """Called in the libp2p thread on every connection change: seed the routing
        table with newly connected peers."""
        if self.dht is None or nursery is None:
            return
        new = [p for p in connected if p not in self._t_seen]
        self._t_seen = set(connected)
        if new:
            nursery.start_soon(self._t_add_peers, new)

    async def _t_add_peers(self, peers: list[ID]) -> None:
        for pid in peers:
            try:
                await self.dht.add_peer(pid)
            except Exception as e:  # noqa: BLE001 - a peer that left meanwhile
                log.debug("routing table add of %s: %s", pid, e)

    async def _t_set_mode(self, server: bool) -> None:
        if self.dht is None:
            return
        mode = DHTMode.SERVER if server else DHTMode.CLIENT
        if self.dht.mode != mode:
            await self.dht.switch_mode(mode)
            log.info("DHT %s mode (%s)", mode.name.lower(),
                     "publicly reachable" if server else "behind NAT")

    def reachability_changed(self) -> None:
        self._wake.set()

    async def run(self) -> None:
        """Follow the reachability verdict: server mode unless behind NAT; a public node
        announces itself under the swarm key, again every REPROVIDE_S."""
        if self.dht is None:
            return
        while True:
            snap = self.ctx.reach.current
            try:
                await self.ctx.bridge.call(self._t_set_mode,
                                             snap.public or snap.verdict.value == "unknown")
                await self.provide_swarm()
                await self.provide_relay()
            except NotRunning:
                return
            self._wake.clear()
            await wait_set(self._wake, REPROVIDE_S)

    # Providers ------------------------------------------------------------------------

    async def provide(self, key: bytes) -> bool:
        """Announce that this node provides `key` to the peers closest to it, at the
        addresses it can be reached at (see the module doc); False if nobody took it."""
        if self.dht is None:
            return False
        snap = self.ctx.reach.current
        if snap.public or snap.verdict.value == "unknown":
            self.ctx.metrics.inc("dht_provides")
            return await self.ctx.bridge.call(self._t_provide, key)
        me = f"/p2p/{self.ctx.peer_id}"
        relayed = [a.removesuffix(me) for a in snap.relay_addrs]
        if not relayed:
            self.ctx.metrics.inc("dht_provides_unreachable")
            log.debug("not providing %s: behind NAT without a relay slot", key.hex()[:16])
            return False
        self.ctx.metrics.inc("dht_provides")
        return await self.ctx.bridge.call(self._t_provide_relayed, key, relayed)

    async def _t_provide(self, key: bytes) -> bool:
        async with self._t_lookup():
            with trio.move_on_after(QUERY_TIMEOUT * 2):
                return bool(await self.dht.provider_store.provide(key))
            return False

    async def _t_provide_relayed(self, key: bytes, addrs: list[str]) -> bool:
        """py-libp2p's provide with our relayed addresses in the record: kept locally, and
        an ADD_PROVIDER to each of the peers closest to the key (ALPHA at a time)."""
        host = self.ctx.host
        me = host.get_id()
        maddrs = [Multiaddr(a) for a in addrs]
        self.dht.provider_store.add_provider(key, PeerInfo(me, maddrs))
        msg = Message(type=Message.MessageType.ADD_PROVIDER, key=key)
        msg.providerPeers.add(id=me.to_bytes(), addrs=[a.to_bytes() for a in maddrs])
        frame = encode_varint_prefixed(msg.SerializeToString())
        sent: list[ID] = []
        gate = trio.Semaphore(ALPHA)

        async def send(peer: ID) -> None:
            async with gate:
                with trio.move_on_after(QUERY_TIMEOUT):
                    stream = None
                    try:
                        stream = await host.new_stream(peer, [PROTOCOL_ID])
                        await stream.write(frame)
                        sent.append(peer)
                    except Exception as e:  # noqa: BLE001 - one peer less holds the record
                        log.debug("ADD_PROVIDER to %s: %s", peer, e)
                    finally:
                        if stream is not None:
                            await close_quietly(stream)

        async with self._t_lookup():
            with trio.move_on_after(QUERY_TIMEOUT * 2):
                closest = await self.dht.peer_routing.find_closest_peers_network(key)
                async with trio.open_nursery() as nursery:
                    for peer in closest:
                        if peer != me:
                            nursery.start_soon(send, peer)
            return bool(sent)

    def _t_connected(self) -> set[ID]:
        return {p for p, cs in list(self.ctx.host.get_network().connections.items()) if cs}

    @asynccontextmanager
    async def _t_lookup(self) -> AsyncIterator[None]:
        """Around one lookup: record the connections its dials open, then close them
        (`_t_close_transient`)."""
        before = self._t_connected()
        dials: list = []
        token = _LOOKUP_DIALS.set(dials)
        try:
            yield
        finally:
            _LOOKUP_DIALS.reset(token)
            await self._t_close_transient(before, dials)

    async def _t_close_transient(self, before: set[ID], dials: list) -> None:
        """A lookup dials the peers it asks (a provide: the ~20 closest to the key, in a
        small swarm everyone). Once it is done, the peers it connected are disconnected
        again if this node has `target_peers` without them: they were for the query, and
        left open they would only be trimmed later, after costing a mesh peer its place.
        Such a peer: not connected before the lookup, every connection to it now one that
        the lookup's own dials opened (`dials`), not in a gossip mesh of ours. A peer that
        also holds another connection (it dialled us, discovery dialled it, a hole punch
        made a direct one) stays, and so does one that the lookup only found connected."""
        ours = {id(c) for c in dials}
        conns = self.ctx.host.get_network().connections
        now = self._t_connected()
        mesh = self._t_mesh_peers()
        new = [pid for pid in now - before
               if pid not in mesh and all(id(c) in ours for c in list(conns.get(pid) or ()))]
        if not new or len(now) - len(new) < self.ctx.cfg.target_peers:
            return
        self.ctx.metrics.inc("dht_connections_closed", len(new))
        log.debug("closing %d connection(s) a DHT lookup opened (%d peers without them): %s",
                  len(new), len(now) - len(new), ", ".join(str(p)[-8:] for p in new))
        async with trio.open_nursery() as nursery:
            for pid in new:
                nursery.start_soon(t_close_peer, self.ctx.host, pid, DEAD_CLOSE_S,
                                   "DHT lookup's own")

    def _t_mesh_peers(self) -> set[ID]:
        router = self.ctx.router
        return {pid for members in list(getattr(router, "mesh", {}).values())
                for pid in list(members)}

    async def find_providers(self, key: bytes, count: int = 20) -> list[tuple[str, list[str]]]:
        """Peers other than us that announced `key`, with the addresses their records carry
        plus any this node learned otherwise (relayed ones first): [(peer id, [full
        multiaddr])]."""
        if self.dht is None:
            return []
        self.ctx.metrics.inc("dht_lookups")
        found = await self.ctx.bridge.call(self._t_find_providers, key, count)
        out = []
        for pid, addrs in found:
            full = [a if a.endswith(f"/p2p/{pid}") else f"{a}/p2p/{pid}" for a in addrs]
            out.append((pid, dial_order(list(dict.fromkeys(self.known_addrs(pid) + full)))))
        return out

    async def _t_find_providers(self, key: bytes, count: int) -> list[tuple[str, list[str]]]:
        async with self._t_lookup():
            return await self._t_walk_providers(key, count)

    async def _t_walk_providers(self, key: bytes, count: int) -> list[tuple[str, list[str]]]:
        store = self.dht.provider_store
        me = self.ctx.host.get_id()
        found: dict[ID, list[str]] = {}

        def take(infos) -> None:
            for info in infos:
                if info.peer_id != me and info.peer_id not in found:
                    found[info.peer_id] = [str(a) for a in info.addrs][:16]

        take(store.get_providers(key))
        queried: set[ID] = set()
        with trio.move_on_after(QUERY_TIMEOUT * 3):
            todo = [p for p in await self.dht.peer_routing.find_closest_peers_network(key)
                    if p != me]
            while todo and len(found) < count and len(queried) < MAX_QUERIED:
                batch, todo = todo[:ALPHA], todo[ALPHA:]
                closer: list[ID] = []

                async def ask(peer: ID, closer=closer) -> None:
                    queried.add(peer)
                    with trio.move_on_after(QUERY_TIMEOUT):
                        providers, nearer = await providers_from_peer(store, peer, key)
                        take(providers)
                        closer.extend(nearer)

                async with trio.open_nursery() as nursery:
                    for peer in batch:
                        nursery.start_soon(ask, peer)
                todo.extend(p for p in dict.fromkeys(closer)
                            if p != me and p not in queried and p not in todo)
        return [(pid.to_base58(), addrs) for pid, addrs in list(found.items())[:count]]

    # Swarm peers ----------------------------------------------------------------------

    def anchors_swarm(self) -> bool:
        """Does this node announce itself under the swarm key? Publicly reachable trainers
        and relays do: long-lived nodes (a provider record lives 48 h, and inference peers
        come and go), and few of them (each announcement walks to the ~20 peers closest to
        the key and dials them: done by every node at once, that churn cost the gossip
        meshes of a 12-node test swarm at target 3 / max 5 over a minute, GossipSub
        penalising the re-grafts)."""
        return (self.ctx.reach.current.public
                and self.ctx.config.node.role in ANCHOR_ROLES)

    async def provide_swarm(self) -> None:
        """Announce this node under the swarm's key (see anchors_swarm)."""
        if self.dht is None or not self.anchors_swarm():
            return
        try:
            await self.provide(self.swarm_key)
        except (P2PError, NotRunning) as e:
            log.debug("providing the swarm key failed: %s", e)

    async def provide_relay(self) -> None:
        """A publicly reachable node that relays (its hop service is on) announces itself
        under the swarm's relay key: NAT'd peers whose connections hold no relay find it
        there (RelayService)."""
        service = self.ctx.cfg.relay.service  # relay.hop_enabled (dht must not import relay)
        hop = service == "on" or (service == "auto" and self.ctx.config.node.role == "relay")
        if self.dht is None or not self.ctx.reach.current.public or not hop:
            return
        try:
            await self.provide(self.relay_key)
        except (P2PError, NotRunning) as e:
            log.debug("providing the relay key failed: %s", e)

    async def relays(self, count: int = 8) -> list[tuple[str, list[str]]]:
        """Public relays of this swarm, found through the DHT."""
        return await self.find_providers(self.relay_key, count)

    async def swarm_peers(self, count: int = 20) -> list[tuple[str, list[str]]]:
        """Publicly reachable peers of this swarm, found through the DHT."""
        return await self.find_providers(self.swarm_key, count)


class _LookupDials(ConnectionNotifee):
    """py-libp2p network notifee: a connection announced inside a lookup's tasks (an
    outbound one is announced from the task that dialled it) is that lookup's."""

    async def connected(self, network, conn) -> None:
        dials = _LOOKUP_DIALS.get()
        if dials is not None:
            dials.append(conn)
