"""Bootstrap, peer exchange and reconnection (asyncio side, on top of P2PNode).

Peer exchange protocol PEERS_PROTOCOL (request/response framing of streams.py):
  request:  a Hello message (msgpack, messages.Hello) with the asker's swarm and listen addrs
  response: msgpack array of at most MAX_PEERS_REPLY entries [peer_id, [multiaddr, ...]]
            (the responder itself first, then the peers it is connected to); or, to an
            asker of another swarm, a PeerRefusal naming the responder's swarm (the asker
            logs one ERROR line with the `--swarm` to pass; the responder disconnects it
            and does not count it as a member)
Every `p2p.discovery_interval_s` a node asks its connected peers for theirs and dials unknown
ones until it holds `p2p.target_peers` connections; lost peers are redialled with
exponential backoff (1 s doubling up to `p2p.reconnect_max_backoff_s`). So a swarm whose
members only know node 0 stays connected after node 0 leaves. A round never waits for its
dials or for a DHT lookup: they run beside it (a dial to a NAT'd peer's private address waits
out `dial_timeout_s`, a DHT lookup from behind NAT took 20-30 s in the netlab), so the next
round acts at once on addresses learned meanwhile (a relay slot a peer just took). While
nothing changes (no new peer learned, no connection gained or lost, nobody left to dial) the
interval doubles, up to QUIET_MAX_FACTOR times: each exchange opens a stream per peer, which
was most of an idle node's CPU (and of a busy one's CPU per gossip message). A quiet round
also asks only one connected peer, in turn, instead of all of them: asking all 7 peers every
round was ~1 ms of the ~5 ms CPU per gossip message per hop in the 8-peer benchmark. Any
change resets both; a change of this node's own addresses also starts the round at once.

Bounds under many identities (issue #30): `known` (peer -> the addresses it was heard at, in
the order last heard of) holds at most MAX_KNOWN peers. When a new one comes and it is full,
one goes: the one heard of longest ago among those whose last redial failed, else the one
heard of longest ago; peers connected now and bootstrap peers never go (a new peer is not
kept when every entry is one of those). A peer is forgotten (dropped from `known` with its
backoff) after MAX_REDIAL_FAILURES failed redials in a row with no word of it between, or
MAX_UNREACHED_FAILURES if no dial of this node ever reached it (it only ever connected to
us, as every identity of a flood does, or was only heard of): word
is its own Hello, a connection, or a peer exchange naming it (peers name only peers they are
connected to). A DHT record naming a forgotten peer at the addresses it was forgotten with is
not word (records outlive their peers); one naming other addresses is. Bootstrap peers are
never forgotten. So after a flood of identities that then leave, each is redialled at most
MAX_UNREACHED_FAILURES times (backoff 1, 2 s), then never again unless heard of anew (a peer
we had dialled, MAX_REDIAL_FAILURES times: backoff 1, 2, 4, 8, 16 s);
a node cut off from every peer for that long keeps only its bootstrap peers and finds the
rest again through them (and the DHT).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from typing import Protocol

from ...protocol.codec import pack, unpack
from ...protocol.errors import ProtocolError
from ...protocol.ids import PEERS_PROTOCOL
from ...protocol.messages import Hello, PeerRefusal
from ..lifecycle import wait_set
from .context import HostContext
from .errors import BootstrapError, DialError, P2PError, RequestError
from .requests import RequestService

log = logging.getLogger(__name__)

MAX_PEERS_REPLY = 64
QUIET_MAX_FACTOR = 8  # a quiet swarm exchanges peers every discovery_interval_s * this
MAX_ADDRS_PER_PEER = 16
MAX_ADDR_LEN = 256
MAX_DIAL_ADDRS = 3  # addresses of one peer tried per redial
DHT_LOOKUP_INTERVAL_S = 30.0  # at most one DHT lookup of swarm peers per this
AGENT = "swarm-node/0.1"
STRAY_GRACE_S = 2.0  # a refused peer of another swarm is disconnected after this
STRAY_FORGET_S = 600.0  # and not counted as a member (nor redialled) for this long
MAX_ROLES = 4096  # peers whose announced role is kept
MAX_KNOWN = 1024  # peers whose addresses are kept (the rule for what goes: module docstring)
MAX_REDIAL_FAILURES = 5  # failed redials in a row, with no word of a peer, before it is forgotten
MAX_UNREACHED_FAILURES = 2  # the same for a peer this node's dials never reached


class SwarmPeerLookup(Protocol):
    """What discovery asks of the DHT (DHTService implements it; dht.py imports this
    module, so not the other way round)."""

    async def swarm_peers(self, count: int = 20) -> list[tuple[str, list[str]]]: ...


class Discovery:
    def __init__(self, ctx: HostContext, requests: RequestService, dht: SwarmPeerLookup):
        self.ctx = ctx
        self.cfg = ctx.cfg
        self.requests = requests
        self.dht = dht
        self.known: dict[str, list[str]] = {}
        self.bootstrap_addrs: list[str] = []
        self._backoff: dict[str, float] = {}
        self._next_try: dict[str, float] = {}
        self._turn = 0  # which connected peer a quiet round asks
        self.strays: dict[str, float] = {}  # peers of another swarm we refused -> when
        self.refused_by: dict[str, str] = {}  # peers that refused us -> their swarm id
        self._bootstrapping = False  # bootstrap() says the mismatches of its own dials
        self._dht_looked = -DHT_LOOKUP_INTERVAL_S
        self._paused: dict[str, float] = {}  # peer -> until: not redialled early (trimmed)
        self.roles: dict[str, str] = {}  # peer -> the role its Hello named (the swarm view)
        self._readvertise = False  # our addresses changed: ask (and so tell) every peer
        self._wake = asyncio.Event()  # run the next round now (our addresses changed)
        self._dials: dict[str, frozenset[str]] = {}  # peer -> addresses its redial tries
        self._dht_task: asyncio.Task | None = None
        self._failures: dict[str, int] = {}  # peer in known -> failed redials since word of it
        self._reached: set[str] = set()  # peers in known that a dial of ours reached
        self._forgotten: dict[str, frozenset[str]] = {}  # peer -> its addresses then (bounded)
        self._bootstrap_ids: set[str] = set()
        self.forgotten = 0  # peers dropped after failed redials
        self.evicted = 0  # peers dropped from a full `known`
        self.redials = 0  # redials started

    def install(self):
        """Serve PEERS_PROTOCOL; returns an awaitable done once the handler is live."""
        return self.requests.set_request_handler(PEERS_PROTOCOL, self._serve_peers)

    def peers_connected(self, new: set[str]) -> None:
        """New connections. One from a peer we were backing off from means the network
        came back (a healed partition, a link up again): redial every peer in backoff at
        the next round instead of at the end of its backoff (up to a minute)."""
        for p in new:
            self._failures.pop(p, None)
        if not any(p in self._backoff for p in new):
            return
        for p in new:
            self._backoff.pop(p, None)
            self._next_try.pop(p, None)
        now = time.monotonic()
        for p in list(self._backoff):
            self._backoff[p] = 0.5
            if self._next_try.get(p, 0) > now and self._paused.get(p, 0) <= now:
                self._next_try[p] = now
        self.ctx.metrics.inc("discovery_backoff_resets")

    def addrs_changed(self) -> None:
        """Our advertised addresses changed (a relay slot taken, a reachability verdict):
        the next round, started at once, asks every connected peer, which
        gives each our new addresses (the Hello) to pass on. In the quiet backoff a NAT'd
        node's relayed address otherwise reached its peers up to a minute late."""
        self._readvertise = True
        self._wake.set()

    def _new_addrs(self, peer: str) -> None:
        """`peer` has other addresses than those our redials failed on (e.g. it took a relay
        slot): it is dialled at the next round, not at the end of its backoff."""
        if self._paused.get(peer, 0) <= time.monotonic():
            self._backoff.pop(peer, None)
            self._next_try.pop(peer, None)

    def pause(self, peer: str, seconds: float) -> None:
        """Do not redial `peer` for `seconds` (e.g. the connection manager closed it)."""
        self._next_try[peer] = max(self._next_try.get(peer, 0.0), time.monotonic() + seconds)
        self._paused[peer] = time.monotonic() + seconds
        if len(self._paused) > 4096:  # bounded: drop the expired ones
            now = time.monotonic()
            self._paused = {p: t for p, t in self._paused.items() if t > now}

    def forget(self, peer: str) -> None:
        """A cut peer: drop its addresses so it is not redialled or handed to others."""
        self._drop(peer)

    def stats(self) -> dict[str, int]:
        """For /status (`p2p.discovery`): how many peers are known, being redialled, and
        were dropped (after failed redials, from a full `known`)."""
        return {"known": len(self.known), "redialling": len(self._dials),
                "backing_off": len(self._backoff), "redials": self.redials,
                "forgotten": self.forgotten, "evicted": self.evicted}

    def _learn(self, peer: str, addrs: list[str]) -> bool:
        """Word of `peer` at `addrs`: keep them (last in `known`'s order) and restart its
        count of failed redials. Returns True if it was not known (and is now kept)."""
        before = self.known.pop(peer, None)
        if before is None and len(self.known) >= MAX_KNOWN and not self._evict():
            return False
        self.known[peer] = addrs
        self._failures.pop(peer, None)
        self._forgotten.pop(peer, None)
        return before is None

    def _evict(self) -> bool:
        """Make room for one peer in a full `known` (the rule: module docstring); False if
        every entry is a peer connected now or a bootstrap peer."""
        keep = set(self.ctx.peers.connected_peers()) | self._bootstrap_ids
        victim = next((p for p in self.known if p not in keep and p in self._failures), None)
        if victim is None:
            victim = next((p for p in self.known if p not in keep), None)
        if victim is None:
            return False
        self._drop(victim)
        self.evicted += 1
        return True

    def _drop(self, peer: str) -> None:
        """Forget `peer`: its addresses, its failed redials and its backoff (a pause the
        connection manager set stays)."""
        self.known.pop(peer, None)
        self._failures.pop(peer, None)
        self._reached.discard(peer)
        self._backoff.pop(peer, None)
        if self._paused.get(peer, 0) <= time.monotonic():
            self._next_try.pop(peer, None)

    def _remember_forgotten(self, peer: str) -> None:
        """Remember at which addresses `peer` was forgotten (a DHT record naming the same
        ones is not word of it); bounded: the oldest goes."""
        self._forgotten.pop(peer, None)
        self._forgotten[peer] = frozenset(self.known.get(peer, ()))
        if len(self._forgotten) > MAX_KNOWN:
            del self._forgotten[next(iter(self._forgotten))]

    # Bootstrap ------------------------------------------------------------------------

    async def bootstrap(self, addrs: list[str]) -> list[str]:
        """Dial every bootstrap address, retrying with backoff, until at least one answers
        or `p2p.bootstrap_timeout_s` passes; then BootstrapError naming each address and
        its last failure. Returns the peer IDs reached."""
        self.bootstrap_addrs = list(addrs)
        self._bootstrap_ids = {a.rsplit("/p2p/", 1)[-1] for a in addrs}
        deadline = time.monotonic() + self.cfg.bootstrap_timeout_s
        last: dict[str, str] = {a: "not tried" for a in addrs}
        delay = 0.5
        while True:
            remaining = deadline - time.monotonic()
            timeout = max(0.5, min(self.cfg.dial_timeout_s, remaining))
            results = await asyncio.gather(*(self._dial(a, timeout) for a in addrs))
            reached = [peer for peer, _ in results if peer]
            for a, (peer, why) in zip(addrs, results):
                if not peer:
                    last[a] = why
            if reached:
                self._bootstrapping = True  # _refused leaves the saying to us
                try:
                    await self.exchange_all()
                finally:
                    self._bootstrapping = False
                refused = [p for p in reached if p in self.refused_by]
                if len(refused) == len(reached):  # the error says it (once, not also logged)
                    raise BootstrapError(self._mismatch_line(reached[0]))
                for peer in refused:
                    log.error(self._mismatch_line(peer))
                return reached
            if time.monotonic() + delay >= deadline:
                break
            if delay == 0.5:  # said at once, not only when the deadline ends the retries
                log.warning("no bootstrap peer reached yet (%s); retrying for up to %.0fs",
                            "; ".join(f"{a}: {last[a]}" for a in addrs), remaining)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 8.0)
        lines = "\n".join(f"  - {a}: {last[a]}" for a in addrs)
        raise BootstrapError(
            f"could not reach any bootstrap peer within {self.cfg.bootstrap_timeout_s:.0f}s:\n"
            f"{lines}\n"
            "Check that the bootstrap node is running, that the address (IP, port and "
            "/p2p/<peer id>) is the one it printed at start, and that no firewall blocks the "
            "TCP port. To start a new swarm instead, run without --bootstrap.")

    async def _dial(self, addr: str, timeout: float) -> tuple[str | None, str]:
        try:
            return await self.ctx.peers.connect(addr, timeout=timeout), ""
        except DialError as e:
            return None, str(e).removeprefix(f"{addr}: ")
        except P2PError as e:
            return None, str(e)

    # Peer exchange --------------------------------------------------------------------

    def _hello(self) -> bytes:
        return Hello(swarm_id=self.ctx.swarm_id, role=self.ctx.config.node.role, agent=AGENT,
                     listen_addrs=self.ctx.peers.advertised_addrs()[:MAX_ADDRS_PER_PEER]).encode()

    def _mismatch_line(self, peer: str) -> str:
        theirs = self.refused_by[peer]
        addr = next((a for a in self.bootstrap_addrs if a.endswith(f"/p2p/{peer}")), peer)
        return (f"swarm id mismatch: bootstrap peer {addr} belongs to swarm {theirs!r}, this "
                f"node to {self.ctx.swarm_id!r}; pass --swarm {theirs} to join it (or start "
                "a separate swarm without --bootstrap)")

    def is_stray(self, peer: str) -> bool:
        """A peer of another swarm that we refused recently (not a member)."""
        when = self.strays.get(peer)
        if when is None:
            return False
        if time.monotonic() - when > STRAY_FORGET_S:
            del self.strays[peer]
            return False
        return True

    def _refuse_stray(self, peer: str, their_swarm: str) -> bytes:
        """Answer a Hello of another swarm with our swarm id (ids are not secrets between
        peers that name the same bootstrap peer), then disconnect it: it is not a member."""
        if peer not in self.strays:
            log.info("refused peer %s: it is in swarm %r, this node in %r (it was told)",
                     peer, their_swarm[:64], self.ctx.swarm_id)
        self.strays[peer] = time.monotonic()
        self._drop(peer)
        self.ctx.spawn(self._drop_stray(peer))
        return PeerRefusal(reason="swarm_mismatch", swarm_id=self.ctx.swarm_id).encode()

    async def _drop_stray(self, peer: str) -> None:
        await asyncio.sleep(STRAY_GRACE_S)  # let the refusal reach it first
        if self.is_stray(peer):
            try:
                await self.ctx.peers.disconnect(peer)
            except P2PError as e:
                log.debug("disconnect of stray %s: %s", peer, e)

    async def _serve_peers(self, peer: str, body: bytes) -> bytes:
        hello = Hello.decode(body)  # capped at the `hello` size limit (protocol/limits.py)
        if hello.swarm_id != self.ctx.swarm_id:
            return self._refuse_stray(peer, hello.swarm_id)
        self.strays.pop(peer, None)
        self.roles.pop(peer, None)
        self.roles[peer] = hello.role
        if len(self.roles) > MAX_ROLES:  # bounded: the oldest Hello goes
            del self.roles[next(iter(self.roles))]
        addrs = [a for a in hello.listen_addrs if a.endswith(f"/p2p/{peer}")]
        if addrs:
            self._learn(peer, addrs)
        entries = [[self.ctx.peer_id, self.ctx.peers.advertised_addrs()[:MAX_ADDRS_PER_PEER]]]
        others = [p for p in self.ctx.peers.connected_peers() if p != peer and p in self.known]
        random.shuffle(others)
        for p in others[:MAX_PEERS_REPLY - 1]:
            entries.append([p, self.known[p][:MAX_ADDRS_PER_PEER]])
        return pack(entries)

    async def exchange(self, peer: str) -> int:
        """Ask `peer` for its peers; returns how many we did not know before."""
        try:
            body = await self.requests.request(peer, PEERS_PROTOCOL, self._hello(),
                                           timeout=self.cfg.dial_timeout_s,
                                           max_response=MAX_PEERS_REPLY * 5000)
            entries = unpack(body, max_size=MAX_PEERS_REPLY * 5000)
        except (RequestError, ProtocolError) as e:
            log.debug("peer exchange with %s failed: %s", peer, e)
            return 0
        if isinstance(entries, dict):
            self._refused(peer, entries)
            return 0
        if not isinstance(entries, list):
            return 0
        self.refused_by.pop(peer, None)
        learned = 0
        for entry in entries[:MAX_PEERS_REPLY]:
            if (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], str)
                    and isinstance(entry[1], list) and len(entry[0]) <= 128):
                pid = entry[0]
                addrs = [a for a in entry[1][:MAX_ADDRS_PER_PEER]
                         if isinstance(a, str) and len(a) <= MAX_ADDR_LEN
                         and a.endswith(f"/p2p/{pid}")]
                if addrs and pid != self.ctx.peer_id:
                    before = self.known.get(pid)
                    if before is not None and set(before) != set(addrs):
                        self._new_addrs(pid)
                        log.debug("new addresses of %s (from %s): %s", pid, peer, addrs)
                    learned += self._learn(pid, addrs)
        return learned

    def _refused(self, peer: str, wire: dict) -> None:
        try:
            refusal = PeerRefusal.from_wire(wire)
        except ProtocolError as e:
            log.debug("unreadable peer-exchange answer from %s: %s", peer, e)
            return
        first = peer not in self.refused_by
        self.refused_by[peer] = refusal.swarm_id
        self._drop(peer)
        if first and not self._bootstrapping:
            log.error(self._mismatch_line(peer))

    async def exchange_all(self) -> int:
        peers = self.ctx.peers.connected_peers()
        return sum(await asyncio.gather(*(self.exchange(p) for p in peers)))

    async def exchange_one(self) -> int:
        """Ask one connected peer, the next in turn (a quiet round)."""
        peers = self.ctx.peers.connected_peers()
        if not peers:
            return 0
        self._turn += 1
        return await self.exchange(peers[self._turn % len(peers)])

    # Maintenance loop -----------------------------------------------------------------

    async def run(self) -> None:
        factor, before = 1, None
        while True:
            changed = True
            self._wake.clear()
            readvertise, self._readvertise = self._readvertise, False
            if readvertise:
                log.debug("our addresses changed: telling every connected peer")
            try:
                learned = await (self.exchange_all() if factor == 1 or readvertise
                                 else self.exchange_one())
                dialled = await self.fill()
                now = frozenset(self.ctx.peers.connected_peers())
                changed = bool(learned or dialled or readvertise) or now != before
                before = now
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - one bad round must not end discovery
                log.warning("discovery round failed: %s: %s", type(e).__name__, e)
            factor = 1 if changed else min(factor * 2, QUIET_MAX_FACTOR)
            await self._sleep_until_change(self.cfg.discovery_interval_s * factor, before)

    async def _sleep_until_change(self, seconds: float, peers: frozenset | None) -> None:
        """Sleep `seconds`, but wake at the next base interval once a connection came or
        went (a lost peer is redialled after one interval, not after the quiet backoff), and
        at once when our addresses changed (`_wake`)."""
        step = self.cfg.discovery_interval_s
        while seconds > 0:
            if await wait_set(self._wake, min(step, seconds)):
                return
            seconds -= step
            if frozenset(self.ctx.peers.connected_peers()) != peers:
                return

    async def fill(self) -> int:
        """Start dials of known peers (and the bootstrap addresses) until target_peers are
        connected or being dialled; returns how many dials were started. A peer whose redial
        is under way is dialled again only at other addresses than that redial tries (it
        took a relay slot meanwhile). Short of peers to dial, a DHT lookup starts beside."""
        connected = set(self.ctx.peers.connected_peers())
        missing = self._missing(connected)
        now = time.monotonic()
        fresh: list[tuple[str, list[str]]] = []  # being dialled, at other addresses than now
        candidates: list[tuple[str, list[str]]] = []
        for pid, addrs in self.known.items():
            if (pid not in connected and self._next_try.get(pid, 0) <= now
                    and not self.ctx.penalties.refused(pid) and pid not in self.refused_by):
                order = dial_order(addrs)
                if pid not in self._dials:
                    candidates.append((pid, order))
                elif self._dials[pid] != frozenset(order[:MAX_DIAL_ADDRS]):
                    fresh.append((pid, order))
        for addr in self.bootstrap_addrs:
            pid = addr.rsplit("/p2p/", 1)[-1]
            if (pid not in connected and pid not in self.known and pid not in self.refused_by
                    and pid not in self._dials and self._next_try.get(pid, 0) <= now):
                candidates.append((pid, [addr]))
        if missing <= 0:
            candidates = []
        elif len(candidates) < missing:
            self._lookup_dht(connected | set(self._dials) | {pid for pid, _ in candidates})
        random.shuffle(candidates)
        chosen = fresh + candidates[:max(0, missing)]
        for pid, addrs in chosen:
            self._start_redial(pid, addrs)
        return len(chosen)

    def _missing(self, connected: set[str]) -> int:
        """How many more peers to dial: target_peers less those connected or being dialled."""
        return self.cfg.target_peers - len(connected | set(self._dials))

    def _lookup_dht(self, exclude: set[str]) -> None:
        """Ask the DHT for swarm peers beside the rounds (one lookup at a time, at most once
        per DHT_LOOKUP_INTERVAL_S) and dial those it names when it answers."""
        busy = self._dht_task is not None and not self._dht_task.done()
        if busy or time.monotonic() - self._dht_looked < DHT_LOOKUP_INTERVAL_S:
            return
        self._dht_task = self.ctx.spawn(self._dial_from_dht(exclude), "discovery dht lookup")

    async def _dial_from_dht(self, exclude: set[str]) -> None:
        try:
            found = await self._from_dht(exclude)
        except Exception as e:  # noqa: BLE001 - as a failed round: discovery goes on
            self.ctx.metrics.inc("discovery_task_failures")
            log.warning("DHT lookup of swarm peers failed: %s: %s", type(e).__name__, e)
            return
        connected = set(self.ctx.peers.connected_peers())
        missing = self._missing(connected)
        chosen = [(p, a) for p, a in found if p not in connected and p not in self._dials]
        for pid, addrs in chosen[:max(0, missing)]:
            self._start_redial(pid, addrs)

    async def _from_dht(self, exclude: set[str]) -> list[tuple[str, list[str]]]:
        """Peers of this swarm from the DHT (its public members), at most once per
        DHT_LOOKUP_INTERVAL_S: peer exchange ran out of peers to dial."""
        now = time.monotonic()
        if now - self._dht_looked < DHT_LOOKUP_INTERVAL_S:
            return []
        self._dht_looked = now
        try:
            found = await self.dht.swarm_peers()
        except P2PError as e:
            log.debug("DHT lookup of swarm peers failed: %s", e)
            return []
        out = []
        for pid, addrs in found:
            addrs = [a for a in addrs[:MAX_ADDRS_PER_PEER] if len(a) <= MAX_ADDR_LEN]
            if pid in exclude or pid == self.ctx.peer_id or not addrs:
                continue
            if pid not in self.known:
                if self._forgotten.get(pid) == frozenset(addrs):
                    continue  # a record that outlived its peer: not word of it
                if not self._learn(pid, addrs):
                    continue
                self.ctx.metrics.inc("dht_peers_found")
            if (self._next_try.get(pid, 0) <= now and not self.ctx.penalties.refused(pid)
                    and pid not in self.refused_by):
                out.append((pid, dial_order(self.known[pid])))
        return out

    def _start_redial(self, pid: str, addrs: list[str]) -> None:
        key = self._dials[pid] = frozenset(addrs[:MAX_DIAL_ADDRS])
        self.redials += 1
        self.ctx.spawn(self._redial(pid, addrs, key), "redial")

    async def _redial(self, pid: str, addrs: list[str], key: frozenset[str]) -> None:
        try:
            await self._dial_in_turn(pid, addrs)
        except Exception as e:  # noqa: BLE001 - as a failed round: discovery goes on
            self.ctx.metrics.inc("discovery_task_failures")
            log.warning("redial of %s failed: %s: %s", pid, type(e).__name__, e)
        finally:
            if self._dials.get(pid) == key:
                del self._dials[pid]

    async def _dial_in_turn(self, pid: str, addrs: list[str]) -> None:
        why: P2PError | None = None
        for addr in addrs[:MAX_DIAL_ADDRS]:
            try:
                await self.ctx.peers.connect(addr)
            except P2PError as e:
                why = e
                continue
            log.debug("dialled %s at %s", pid, addr)
            self._backoff.pop(pid, None)
            self._next_try.pop(pid, None)
            self._failures.pop(pid, None)
            await self.exchange(pid)
            if pid in self.known:
                self._reached.add(pid)
            return
        if pid in self.ctx.peers.connected_peers():
            return  # another dial (at addresses learned meanwhile) reached it
        if pid in self.known and pid not in self._bootstrap_ids:
            failures = self._failures[pid] = self._failures.get(pid, 0) + 1
            if failures >= (MAX_REDIAL_FAILURES if pid in self._reached
                            else MAX_UNREACHED_FAILURES):
                self._remember_forgotten(pid)
                self._drop(pid)
                self.forgotten += 1
                log.debug("forgot %s after %d failed redials (%s)", pid, failures, why)
                return
        elif pid not in self._bootstrap_ids:
            return  # dropped from `known` meanwhile: no backoff kept for it
        backoff = min(self._backoff.get(pid, 0.5) * 2, self.cfg.reconnect_max_backoff_s)
        self._backoff[pid] = backoff
        self._next_try[pid] = time.monotonic() + backoff
        log.debug("redial of %s failed (%s); next try in %.0fs", pid, why, backoff)


def dial_order(addrs: list[str]) -> list[str]:
    """Which of a peer's advertised addresses to try first. A peer that advertises relayed
    (`/p2p-circuit`) addresses is not publicly reachable: its relays first (hole punching
    then upgrades the connection where the NATs allow), its own addresses after (they work
    from its LAN). Otherwise its addresses as advertised."""
    circuits = [a for a in addrs if "/p2p-circuit" in a]
    if not circuits:
        return list(addrs)
    return circuits + [a for a in addrs if "/p2p-circuit" not in a]
