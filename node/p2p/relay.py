"""NAT traversal: Circuit Relay v2 (py-libp2p's, patched in patches/relay.py) and DCUtR.

- Hop (relay) service: on for the relay role, or when `p2p.relay.service = "on"`. A relay
  holds at most `max_reservations` reservations (a NAT'd peer's slot: others reach it
  through us), `max_circuits_per_peer` relayed connections per reserved peer, each for at
  most `circuit_duration_s` seconds and `circuit_bytes` bytes (both directions); past a
  limit the circuit is reset and the peers redial (a new circuit).
- Stop side (every node): accepts connections relayed to it.
- Client (every node while not public, `p2p.relay.client`): reserves slots on up to
  `p2p.relay.reservations` connected peers that offer the hop protocol and are reached
  directly; short of those, on relays the DHT names (public relays provide the swarm's
  relay key, dht.py), dialled for it: a lookup at most once per RELAY_LOOKUP_S while
  holding none, RELAY_LOOKUP_HOLDING_S while holding too few. Refreshes them before they
  expire, replaces a relay that leaves, and publishes its `/p2p-circuit` addresses (ReachabilityTracker.relay_addrs; discovery
  advertises them).
- Circuit dials: `t_dial_circuit` for a `.../p2p-circuit/p2p/<peer>` address.
- DCUtR (`p2p.hole_punching`): py-libp2p's service upgrades relayed connections to direct
  ones (RTT-synchronised TCP simultaneous open); the relayed connection closes 60 s after.
  Its dials wait at most `p2p.dial_timeout_s`, the direct dial that starts each attempt at
  most 3 s (patches/dcutr.py: a NAT'd peer's private addresses never answer from outside).
- Connection log (`ConnectionLog`, DEBUG): every connection opened and closed, direct or
  relayed, inbound or outbound, its age at the close and who closed it (a close of ours
  names its reason, closing.closed_by): where a hole-punched connection went.

Methods named `_t_*` / `t_*` run in the libp2p (trio) thread.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Protocol

import multiaddr
import trio
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo
from libp2p.relay.circuit_v2.config import RelayConfig, RelayRole
from libp2p.relay.circuit_v2.dcutr import MAX_HOLE_PUNCH_ATTEMPTS
from libp2p.relay.circuit_v2.pb.circuit_pb2 import HopMessage
from libp2p.relay.circuit_v2.protocol import PROTOCOL_ID as HOP_PROTOCOL_ID
from libp2p.relay.circuit_v2.protocol_buffer import StatusCode
from libp2p.relay.circuit_v2.resources import RelayLimits
from libp2p.relay.circuit_v2.transport import CircuitV2Transport
from libp2p.relay.circuit_v2.utils import read_delimited_msg, write_delimited_msg

from ..lifecycle import wait_set
from .closing import closed_by
from .context import ConnectionNotifee, HostContext
from .dialback import ip_tcp, transport_addrs
from .errors import DialError, NotRunning, P2PError
from .patches.dcutr import DCUtRService
from .patches.internals import hole_punch_state, hop_stream_handler
from .patches.relay import RelayProtocol
from .streams import close_quietly, reset_quietly

if TYPE_CHECKING:
    from .discovery import Discovery


class RelayFinder(Protocol):
    """Where a NAT'd node looks up relays (DHTService: public relays provide the relay key;
    an empty list when the DHT is off)."""

    async def relays(self, count: int = 8) -> list[tuple[str, list[str]]]: ...

log = logging.getLogger(__name__)

RESERVE_TIMEOUT_S = 10.0
REFRESH_MARGIN = 0.25  # refresh a reservation when this share of its TTL is left
RETRY_RELAY_S = 30.0  # a relay that refused us is not asked again for this long
CLIENT_POLL_S = 2.0  # how often the client looks at its reservations
RELAY_LOOKUP_S = 60.0  # at most one DHT lookup of relays this often while holding none
RELAY_LOOKUP_HOLDING_S = 600.0  # ... and this often while holding some, but too few
RELAY_LOOKUP_DIALS = 4  # relays from one lookup dialled at most


def hop_enabled(config) -> bool:
    service = config.p2p.relay.service
    return service == "on" or (service == "auto" and config.node.role == "relay")


class RelayService:
    """Relay, relay client and hole punching of one P2PNode."""

    def __init__(self, ctx: HostContext, discovery: Discovery, dht: RelayFinder | None = None):
        self.ctx = ctx
        self.cfg = ctx.cfg.relay
        self.hop = hop_enabled(ctx.config)
        self.discovery = discovery
        self.dht = dht  # where relays are looked up when the connections hold too few
        self.protocol: RelayProtocol | None = None
        self.dcutr: DCUtRService | None = None
        self._dialer: CircuitV2Transport | None = None
        # relay peer id -> (its dialable address, reservation expiry as unix time)
        self.reservations: dict[str, tuple[str, float]] = {}
        self._refused_until: dict[str, float] = {}
        self._looked = -RELAY_LOOKUP_S  # monotonic time of the last DHT lookup of relays
        self._wake = asyncio.Event()
        self.hole_punch = {"direct": 0, "failed": 0, "gave_up": 0, "in_progress": 0}
        self.punched: set[str] = set()  # peers DCUtR upgraded to a direct connection

    # trio side: services -------------------------------------------------------------------

    def t_services(self, host) -> list:
        """The py-libp2p services to run beside pubsub (built in the libp2p thread)."""
        cfg = self.cfg
        limits = RelayLimits(duration=cfg.circuit_duration_s, data=cfg.circuit_bytes,
                             max_circuit_conns=cfg.max_circuits_per_peer,
                             max_reservations=cfg.max_reservations,
                             reservation_ttl=cfg.reservation_ttl_s)
        self.protocol = RelayProtocol(host, limits=limits, allow_hop=self.hop)
        self._dialer = CircuitV2Transport(host, self.protocol,
                                          RelayConfig(roles=RelayRole.STOP, limits=limits))
        services = [self.protocol]
        if log.isEnabledFor(logging.DEBUG):
            host.get_network().register_notifee(ConnectionLog())
        if self.ctx.cfg.hole_punching:
            # Its dials wait p2p.dial_timeout_s (py-libp2p's own default is 10 s, whatever
            # the config says; its punch rounds cut them at 5 s themselves), except the
            # direct dial each attempt starts with (patches/dcutr.py: UNILATERAL_DIAL_S).
            self.dcutr = DCUtRService(host, dial_timeout=self.ctx.cfg.dial_timeout_s)
            services.append(self.dcutr)
        return services

    def t_guard_hop(self, host) -> None:
        """Once the relay runs: refuse hop requests (reservations, circuits) from peers our
        penalties or peer filter refuse."""
        if not self.hop or self.protocol is None:
            return
        inner = hop_stream_handler(self.protocol)

        async def guarded(stream) -> None:
            peer = stream.muxed_conn.peer_id.to_base58()
            if not self.ctx.allowed(peer):
                self.ctx.metrics.inc("relay_refused_peer")
                await reset_quietly(stream)
                return
            await inner(stream)

        host.set_stream_handler(HOP_PROTOCOL_ID, guarded)

    async def t_dial_circuit(self, addr: multiaddr.Multiaddr, peer: ID) -> None:
        """Connect to `peer` through the relay named in `addr` (`<relay addr>/p2p/<relay>
        /p2p-circuit/p2p/<peer>`)."""
        if self._dialer is None:
            raise NotRunning("the relay client is not running")
        _relay_addr, target = self._dialer.parse_circuit_ma(addr)
        if target != peer:
            raise DialError(f"{addr} leads to {target}, not {peer}", reason="wrong_peer")
        self.ctx.metrics.inc("relay_dials")
        try:
            await self._dialer.dial(addr)
        except Exception:
            self.ctx.metrics.inc("relay_dial_failures")
            raise

    async def _t_reserve(self, relay: str, addr: str) -> tuple[bool, float, str]:
        """One RESERVE on `relay`: (ok, expiry unix time, why not)."""
        host = self.ctx.host
        rid = ID.from_base58(relay)
        stream = None
        try:
            with trio.fail_after(RESERVE_TIMEOUT_S):
                if not host.get_network().connections.get(rid):
                    await host.connect(PeerInfo(rid, [multiaddr.Multiaddr(addr)]))
                stream = await host.new_stream(rid, [HOP_PROTOCOL_ID])
                await write_delimited_msg(stream, HopMessage(type=HopMessage.RESERVE))
                resp = await read_delimited_msg(stream, HopMessage)
        except trio.TooSlowError:
            return False, 0.0, "timeout"
        except Exception as e:  # noqa: BLE001 - reported as the reason
            return False, 0.0, f"{type(e).__name__}: {e}"[:120]
        finally:
            if stream is not None:
                await close_quietly(stream)
        status = StatusCode(resp.status) if resp.HasField("status") else StatusCode.OK
        if status != StatusCode.OK:
            return False, 0.0, status.name.lower()
        expire = float(resp.reservation.expire) if resp.HasField("reservation") else 0.0
        return True, expire or time.time() + 60.0, ""

    def _t_hop_peers(self) -> list[str]:
        """Connected peers that offer the hop protocol (identify told us)."""
        host = self.ctx.host
        out = []
        for pid in host.get_connected_peers():
            try:
                protocols = host.get_peerstore().get_protocols(pid) or []
            except Exception as e:  # noqa: BLE001 - not identified yet
                log.debug("protocols of %s: %s", pid, e)
                continue
            if HOP_PROTOCOL_ID in protocols:
                out.append(pid.to_base58())
        return out

    def _t_hole_punch_state(self) -> tuple[dict[str, int], set[str], set[str]]:
        """DCUtR's bookkeeping as peer ids: attempts per peer, peers with an attempt under
        way, peers its own attempts upgraded to a direct connection."""
        if self.dcutr is None:
            return {}, set(), set()
        attempts, in_progress, direct = hole_punch_state(self.dcutr)
        return ({p.to_base58(): n for p, n in attempts.items()},
                {p.to_base58() for p in in_progress}, {p.to_base58() for p in direct})

    def _hole_punch_stats(self, attempts: dict[str, int], in_progress: set[str],
                          direct: set[str]) -> dict[str, int]:
        """For /status: peers behind NAT held over a direct connection (`direct`: whichever
        side's attempt made it; py-libp2p counts only the side whose own dial won), peers
        whose attempts failed and that are not direct by the other side's (`failed`, still
        tried up to MAX_HOLE_PUNCH_ATTEMPTS), those whose attempts ran out (`gave_up`), and
        attempts under way (`in_progress`)."""
        punched = direct | self.ctx.peers.hole_punched_peers()
        done = [(p, n) for p, n in attempts.items() if p not in in_progress and p not in punched]
        return {"direct": len(punched), "failed": len(done),
                "gave_up": sum(1 for _p, n in done if n >= MAX_HOLE_PUNCH_ATTEMPTS),
                "in_progress": len(in_progress)}

    # asyncio side: the client ---------------------------------------------------------------

    def circuit_addrs(self) -> list[str]:
        me = self.ctx.peer_id
        return [f"{addr}/p2p/{relay}/p2p-circuit/p2p/{me}"
                for relay, (addr, _exp) in sorted(self.reservations.items())]

    def relay_in_use(self, peer: str) -> bool:
        return peer in self.reservations

    def stats(self) -> dict:
        """For /status (`p2p.relay`)."""
        p = self.protocol
        out = {"service": self.hop, "reservations_held": sorted(self.reservations),
               "hole_punch": dict(self.hole_punch)}
        if self.hop and p is not None:
            out.update(reserved_peers=p.resource_manager.active(), circuits=p.circuits,
                       circuits_total=p.circuits_total,
                       max_reservations=self.cfg.max_reservations)
        return out

    async def run(self) -> None:
        """Hold reservations while this node is not publicly reachable."""
        while True:
            try:
                await self._round()
            except asyncio.CancelledError:
                raise
            except NotRunning:
                return
            except Exception as e:  # noqa: BLE001 - one bad round must not end the client
                log.warning("relay client round failed: %s: %s", type(e).__name__, e)
            self._wake.clear()
            await wait_set(self._wake, CLIENT_POLL_S)

    def wake(self) -> None:
        self._wake.set()

    def reachability_changed(self, snap) -> None:
        self._wake.set()
        if self.hop and snap.verdict.value in ("relayed", "direct", "unreachable"):
            log.warning("this node relays for NAT'd peers (p2p.relay.service) but is not "
                        "publicly reachable itself: they cannot reserve a slot through it; "
                        "run the relay on a public address or forward its TCP port")

    async def _round(self) -> None:
        ctx = self.ctx
        reach = ctx.reach.current
        attempts, in_progress, self.punched = await ctx.bridge.call(
            _async, self._t_hole_punch_state)
        self.hole_punch = self._hole_punch_stats(attempts, in_progress, self.punched)
        # The verdict counts direct connections to NAT'd peers, not only the ones our own
        # DCUtR attempts made: when the peer's attempt won, ours never started (a NAT pair
        # test saw `direct` on one side and `relayed` on the other, under load).
        ctx.reach.set_direct_peers(len(ctx.peers.hole_punched_peers()))
        want = self.cfg.client and not reach.public and reach.verdict.value != "unknown"
        connected = set(ctx.peers.connected_peers())
        for relay in [r for r in self.reservations if r not in connected]:
            log.info("relay %s left; its reservation is gone", relay)
            del self.reservations[relay]
        if not want:
            if self.reservations and reach.public:
                self.reservations.clear()  # public: let them expire, stop advertising
        else:
            await self._refresh()
            missing = self.cfg.reservations - len(self.reservations)
            if missing > 0:
                await self._reserve_more(missing, connected)
        ctx.reach.set_relay_addrs(self.circuit_addrs())

    async def _refresh(self) -> None:
        now = time.time()
        ttl = self.cfg.reservation_ttl_s
        for relay, (addr, expire) in list(self.reservations.items()):
            if expire - now > ttl * REFRESH_MARGIN:
                continue
            ok, new_expire, why = await self.ctx.bridge.call(self._t_reserve, relay, addr)
            if ok:
                self.reservations[relay] = (addr, new_expire)
                self.ctx.metrics.inc("relay_reservations_refreshed")
            else:
                log.info("relay %s did not renew our reservation (%s)", relay, why)
                del self.reservations[relay]

    async def _reserve_more(self, missing: int, connected: set[str]) -> None:
        ctx = self.ctx
        now = time.monotonic()
        hop_peers = await ctx.bridge.call(_async, self._t_hop_peers)
        candidates = [p for p in hop_peers
                      if p in connected and p not in self.reservations
                      and not ctx.peers.is_relayed(p) and self._refused_until.get(p, 0) <= now]
        for relay in candidates[:missing]:
            addr = self._dialable_addr(relay)
            if addr is not None:
                await self._try_reserve(relay, addr)
        missing = self.cfg.reservations - len(self.reservations)
        if missing > 0:
            await self._reserve_found(missing)

    async def _try_reserve(self, relay: str, addr: str) -> bool:
        ctx, now = self.ctx, time.monotonic()
        ok, expire, why = await ctx.bridge.call(self._t_reserve, relay, addr)
        if ok:
            self.reservations[relay] = (addr, expire)
            ctx.metrics.inc("relay_reservations")
            log.info("reserved a relay slot on %s: reachable at %s/p2p/%s/p2p-circuit",
                     relay, addr, relay)
            # Advertised at once, not at the end of the round: a DHT lookup for more relays
            # (short of `reservations`) may follow and took ~30 s in the NAT lab, all that
            # time the node was "unreachable" and told its peers its private address only.
            ctx.reach.set_relay_addrs(self.circuit_addrs())
        else:
            self._refused_until[relay] = now + RETRY_RELAY_S
            ctx.metrics.inc("relay_reservations_refused")
            log.info("relay %s refused a reservation (%s)", relay, why)
        return ok

    async def _reserve_found(self, missing: int) -> None:
        """Relays the DHT names (the connections held too few): dial and reserve."""
        ctx, now = self.ctx, time.monotonic()
        every = RELAY_LOOKUP_HOLDING_S if self.reservations else RELAY_LOOKUP_S
        if self.dht is None or now - self._looked < every:
            return
        self._looked = now
        ctx.metrics.inc("relay_lookups")
        try:
            found = await self.dht.relays()
        except P2PError as e:
            log.debug("DHT lookup of relays failed: %s", e)
            return
        tried = 0
        for relay, addrs in found:
            if missing <= 0 or tried >= RELAY_LOOKUP_DIALS:
                return
            if relay in self.reservations or self._refused_until.get(relay, 0) > now:
                continue
            direct = [a for a in addrs if ip_tcp(a) is not None][:2]
            if not direct:
                continue
            tried += 1
            for addr in direct:
                try:
                    await ctx.peers.connect(addr)
                except P2PError as e:
                    log.debug("relay %s from the DHT: dialling %s failed: %s", relay, addr, e)
                    continue
                if await self._try_reserve(relay, addr.removesuffix(f"/p2p/{relay}")):
                    missing -= 1
                break

    def _dialable_addr(self, relay: str) -> str | None:
        """The relay's address as others can dial it: the one it advertises (peer
        exchange) at the IP our connection to it reaches, else that connection's address
        (its listen address when we dialled it), else the first it advertises."""
        conn = self.ctx.peers.direct_addr_of(relay)
        known = self.discovery.known.get(relay, []) if self.discovery else []
        bases = [a.removesuffix(f"/p2p/{relay}") for a in known]
        bases = [b for b in bases if ip_tcp(b) is not None]
        if conn is not None:
            ip = ip_tcp(conn)[1]
            same_ip = [b for b in bases if ip_tcp(b)[1] == ip]
            return same_ip[0] if same_ip else conn
        return bases[0] if bases else None


async def _async(fn):
    """Run the synchronous `fn` in the trio thread (for bridge.call)."""
    return fn()


def connection_addr(conn) -> str | None:
    """The remote /ipX/../tcp/N of a direct connection, else None."""
    for a in transport_addrs(conn):
        if ip_tcp(str(a)) is not None:
            return str(a)
    return None


class ConnectionLog(ConnectionNotifee):
    """py-libp2p network notifee: a DEBUG line per connection opened and closed (libp2p
    thread). At the close it says how the connection's reads and writes ended (yamux reads
    its secured connection until that fails: EOF, a reset, a decryption error), recorded by
    wrapping the secured connection's read and write (this connection only, DEBUG only)."""

    def __init__(self):
        self._opened: dict[int, float] = {}  # id(connection) -> monotonic time it opened
        self._ended: dict[int, list[str]] = {}  # id(connection) -> how reads/writes ended

    def _watch(self, conn) -> None:
        secured = getattr(conn.muxed_conn, "secured_conn", None)
        if secured is None:
            return
        ended = self._ended.setdefault(id(conn), [])
        read, write = secured.read, secured.write

        async def watched_read(n=None):
            try:
                data = await read(n)
            except BaseException as e:
                ended.append(f"read raised {type(e).__name__}: {str(e)[:120]}")
                raise
            if not data:
                ended.append("read EOF")
            return data

        async def watched_write(data):
            try:
                return await write(data)
            except BaseException as e:
                ended.append(f"write raised {type(e).__name__}: {str(e)[:120]}")
                raise

        try:
            secured.read, secured.write = watched_read, watched_write
        except AttributeError:  # a secured connection without a __dict__: not watched
            pass

    @staticmethod
    def _describe(conn) -> str:
        addr = connection_addr(conn)
        kind = f"direct {addr}" if addr is not None else "relayed"
        return f"{kind}, {getattr(conn, 'direction', '?')}"

    async def connected(self, network, conn) -> None:
        self._opened[id(conn)] = time.monotonic()
        self._watch(conn)
        log.debug("connection to %s opened: %s", conn.muxed_conn.peer_id, self._describe(conn))

    async def disconnected(self, network, conn) -> None:
        t0 = self._opened.pop(id(conn), None)
        age = f"{time.monotonic() - t0:.1f} s" if t0 is not None else "?"
        why = closed_by(conn)
        ended = self._ended.pop(id(conn), None) or []
        log.debug("connection to %s closed after %s: %s; %s; %s", conn.muxed_conn.peer_id, age,
                  self._describe(conn),
                  f"closed by us ({why})" if why else "not closed by our code (the other "
                  "side, the path, or py-libp2p)",
                  "; ".join(ended[:3]) or "reads and writes had not failed")
