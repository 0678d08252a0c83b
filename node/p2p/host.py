"""P2PNode: the asyncio API of the libp2p host (Noise only, Yamux only, TCP).

The host, GossipSub and all stream handlers live in a trio thread (bridge.py); every public
method here is asyncio and crosses into that thread without blocking the event loop.
Split along py-libp2p's seams: this module owns the host lifecycle, connections, health and
how peers are treated; `pubsub.py` (GossipService) the topics; `requests.py`
(RequestService) streams and request/response; discovery, dial-back, relay, DHT and the
connection manager their own modules. Each service gets the narrow `HostContext`
(context.py); callers use the service they mean (`node.gossip.publish`, ...).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from typing import Self

import multiaddr
import trio
from libp2p import new_host
from libp2p.crypto.x25519 import create_new_key_pair as create_x25519_key_pair
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import info_from_p2p_addr
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
from libp2p.security.noise.transport import Transport as NoiseTransport
from libp2p.stream_muxer.yamux.yamux import PROTOCOL_ID as YAMUX_PROTOCOL_ID
from libp2p.stream_muxer.yamux.yamux import Yamux
from libp2p.tools.anyio_service import background_trio_service

from ...protocol.ids import BULK_PROTOCOL, FETCH_PROTOCOL
from ...protocol.messages import WireModel
from . import patches
from .admission import Admission, ValidationQueue
from .bridge import TrioBridge
from .bulk import BulkPlane
from .closing import t_close_peer
from .connmgr import ConnectionManager
from .context import ConnectionNotifee, HostContext
from .dht import DHTService
from .dialback import Dialback
from .discovery import Discovery
from .errors import BadMultiaddr, DialError, NotRunning, P2PError
from .gossip import GossipValidator, build_gossip
from .metrics import P2PMetrics
from .penalties import PeerPenalties
from .pubsub import GossipService, Handler
from .reachability import (
    MAX_PEER_REACH,
    Reachability,
    ReachabilityTracker,
    Verdict,
    peer_reach,
)
from .relay import RelayService, connection_addr
from .requests import RequestHandler, RequestService, StreamHandler
from .streams import AsyncStream

log = logging.getLogger(__name__)

SHUTDOWN_QUIESCE_S = 3.0  # at most this long disconnecting peers before the services stop


class P2PNode:
    """A swarm peer (implements `swarm_node.node.p2p.Transport`). `config` is the whole
    Config tree (uses `node`, `p2p`, `bulk`, `limits`).

    The node owns the host's lifecycle, its connections, how it treats peers (penalties,
    filter, established peers) and its health; the services are its public attributes and
    callers use the one they mean: `gossip` (topics), `requests` (streams and
    request/response), `bulk` (the TLS plane), `dht` (provider records), `connmgr`
    (protection from trimming), `reach` (reachability). The services share a narrow
    `HostContext` (context.py), never the node."""

    def __init__(self, identity, config):
        self.identity = identity
        self.config = config
        self.cfg = config.p2p
        self.swarm_id = config.node.swarm_id
        self.peer_id: str = identity.peer_id
        self.metrics = P2PMetrics()
        self.penalties = PeerPenalties(self._cut)
        self.reach = ReachabilityTracker()  # fed by the dial-back check and the relay client
        self.reach.subscribe(_log_reachability)
        ctx = self._ctx = HostContext(identity, config, metrics=self.metrics,
                                      bridge=TrioBridge(f"p2p-{self.peer_id[-6:]}"),
                                      penalties=self.penalties, reach=self.reach, peers=self)
        ctx.bridge.on_death = self._on_host_death
        self._connected: set[str] = set()
        self._direct_addr: dict[str, str] = {}  # peer -> remote address of a direct conn
        self._outbound: set[str] = set()  # peers with a direct connection this node dialled
        # peer ID -> (trio.Event set when our dial to it ends, is it a circuit dial)
        self._dialing: dict = {}
        # TCP's congestion control and loss-recovery floor on every socket: libp2p's and
        # the bulk plane's
        patches.tcp_tuning.configure(config.p2p.tcp_rto_min_ms,
                                       congestion=config.p2p.tcp_congestion)
        self.admission = Admission(self.penalties, self.metrics, self_id=self.peer_id)
        self.validation_queue = ValidationQueue(self.admission)  # received, not yet validated
        self.requests = RequestService(ctx)  # request/response seam
        # shards and gossip bodies over TLS beside libp2p (bulk/); started in start()
        self.bulk = BulkPlane(identity, config.bulk, self.metrics, allowed=ctx.allowed,
                              request=self.requests.request, peer_ip=self.peer_ip)
        # A node behind NAT advertises no bulk endpoint (nobody could dial it).
        self.bulk.reachable = lambda: self.reach.current.verdict in (Verdict.PUBLIC,
                                                                     Verdict.UNKNOWN)
        validator = GossipValidator(self.peer_id, ctx.limits, self.metrics, lambda: ctx.allowed,
                                    config.limits.max_clock_skew_s,
                                    on_reject=self.penalties.penalise, admission=self.admission)
        self.gossip = GossipService(ctx, validator, self.requests, self.bulk,
                                    report=self.report_misbehaviour)  # pubsub seam
        self.dht = DHTService(ctx, known_addrs=lambda pid: self.discovery.known.get(pid, []))
        self.discovery = Discovery(ctx, self.requests, self.dht)
        self.dialback = Dialback(ctx, self.requests)
        self.relay = RelayService(ctx, self.discovery, self.dht)
        self.connmgr = ConnectionManager(ctx, self.relay, self.discovery)
        self.reach.subscribe(lambda _snap: self.dht.reachability_changed())
        self.reach.subscribe(self.relay.reachability_changed)
        self.reach.subscribe(lambda _snap: self.discovery.addrs_changed())
        self.failure: str | None = None
        self._failed = asyncio.Event()
        self._started = False

    # Lifecycle ------------------------------------------------------------------------

    async def start(self, *, bootstrap: list[str] | None = None, discovery: bool = True) -> None:
        """Start the host, listen, and (if any) join through the bootstrap peers.

        Raises BootstrapError (naming every address and why it failed) if bootstrap peers
        were given and none could be reached within `p2p.bootstrap_timeout_s`."""
        if self._started:
            raise P2PError("this P2PNode was already started; create a new one to restart",
                           reason="already_started")
        self._started = True
        ctx = self._ctx
        listen = [_parse_maddr(a, need_peer=False) for a in self.config.node.listen]
        try:
            await ctx.bridge.start(lambda started: self._trio_main(started, listen))
        except Exception as e:
            raise P2PError(f"cannot start the libp2p host on {', '.join(map(str, listen))}: "
                           f"{_flatten(e)}", reason="listen_failed") from e
        await self.requests.set_request_handler(FETCH_PROTOCOL, self.gossip.serve_payload)
        try:
            await self.bulk.start(self.config.node.listen)
        except BaseException:
            await self.close()
            raise
        await self.requests.set_request_handler(BULK_PROTOCOL, self.bulk.serve_query)
        self.gossip.start_bodies()
        await self.gossip.subscribe_pending()
        await self.discovery.install()
        await self.dialback.install()
        addrs = self.config.node.bootstrap if bootstrap is None else bootstrap
        ctx.spawn(self.connmgr.run(), "connection manager")
        ctx.spawn(self.connmgr.run_liveness(), "liveness")
        try:
            if addrs:
                await self.discovery.bootstrap(addrs)
            if discovery:
                ctx.spawn(self.discovery.run(), "discovery")
                ctx.spawn(self.dialback.run(), "dial-back")
                ctx.spawn(self.relay.run(), "relay client")
                ctx.spawn(self.dht.run(), "dht")
        except BaseException:
            await self.close()
            raise

    async def close(self) -> None:
        """Quiesce (stop our tasks, close connections), stop the host, join its thread."""
        ctx = self._ctx
        if ctx.closing:
            return
        ctx.closing = True
        await ctx.tasks.close()
        await self.bulk.close()
        await ctx.bridge.stop()

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    @property
    def running(self) -> bool:
        return self._ctx.running

    @property
    def listen_addrs(self) -> list[str]:
        """Full multiaddrs (with /p2p/<us>) this node listens on; empty before start."""
        return self._ctx.listen_addrs

    @property
    def context(self) -> HostContext:
        """What the services share (the live py-libp2p handles among it): for the node's
        own package and for tests that look at py-libp2p's state."""
        return self._ctx

    @property
    def shutdown_errors(self) -> list[str]:
        return list(self._ctx.bridge.shutdown_errors)

    # Health (a supervised host) -------------------------------------------------------

    def _on_host_death(self, why: str) -> None:
        self.failure = why
        self._failed.set()
        log.error("the libp2p host died (%s); this node can no longer reach its peers", why)

    async def wait_failed(self) -> str:
        """Return (with one line saying why) once the libp2p thread ended without
        `close()`: the runner then exits non-zero so a supervisor restarts the node."""
        await self._failed.wait()
        return self.failure or "unknown"

    def health(self) -> dict:
        """For /status: `alive` is False from the moment the libp2p thread ends."""
        c = self.metrics.counters
        return {"alive": self.running and self.failure is None, "failure": self.failure,
                "reachability": self.reach.current.as_dict(),
                "relay": self.relay.stats(),
                "connections": {"open": len(self._connected), "target": self.cfg.target_peers,
                                "max": self.cfg.max_peers, "relayed": len(self._connected)
                                - len(self._direct_addr), "trimmed": self.connmgr.trimmed,
                                "dead": self.connmgr.dead,
                                "relayed_peers": sorted(self._connected - set(self._direct_addr))},
                "peer_reach": self.peer_reach(),
                "discovery": self.discovery.stats(),
                "peer_roles": self.peer_roles(),
                "stream_faults": c.get("stream_faults", 0),
                "rate_limited": c.get("rejected.rate_limited", 0),
                "window_violations": c.get("window_violations", 0),
                "over_budget": c.get("rejected.over_budget", 0),
                "validation_queue": len(self.validation_queue),
                "validation_queue_peak_bytes": self.validation_queue.peak_bytes,
                **self.penalties.snapshot()}

    def peer_reach(self) -> dict[str, list[str]]:
        """For /status (`p2p.peer_reach`): how each known peer is reachable, as far as this
        node saw (reachability.peer_reach): peer -> [kind, evidence]."""
        members = set(self.connected_peers())
        kinds = peer_reach(connected=members, relayed=members - set(self._direct_addr),
                           outbound=self._outbound, punched=self.relay.punched,
                           advertised=dict(self.discovery.known),
                           probed=dict(self.dialback.probed))
        return {peer: list(kind) for peer, kind in kinds.items()}

    def hole_punched_peers(self) -> set[str]:
        """Connected peers behind NAT that we hold a direct connection with (peer_reach
        `hole-punched`): whichever side's DCUtR attempt made it. Only the side whose own
        attempt succeeded has the peer in its DCUtR bookkeeping (`relay.punched`); when
        the other side's attempt won, this node holds the same direct connection."""
        return {peer for peer, (kind, _why) in self.peer_reach().items()
                if kind == "hole-punched"}

    def peer_roles(self) -> dict[str, str]:
        """For /status (`p2p.peer_roles`): the role each peer named in its peer-exchange
        Hello (connected peers first, at most MAX_PEER_REACH)."""
        roles = self.discovery.roles
        members = [p for p in self.connected_peers() if p in roles]
        rest = [p for p in roles if p not in set(members)]
        return {p: roles[p] for p in (members + rest)[:MAX_PEER_REACH]}

    # How peers are treated ------------------------------------------------------------

    def report_misbehaviour(self, peer_id: str, n: int = 1, reason: str = "bogus_batch") -> bool:
        """Add `n` offences of `reason` (penalties.POINTS) to `peer_id`, the origin of the
        bad work (its signed key); past the threshold it is refused for a backoff: its gossip
        is dropped here and, if it is a direct connection, the connection is cut. A peer that
        only relayed the origin's messages is never charged; the connection that introduced a
        new origin loses new-origin tokens instead (admission.py), so one that keeps bringing
        fresh bogus keys is throttled. Returns True if this report cut the origin. Any
        thread."""
        self.admission.reported(peer_id, n)
        return self.penalties.penalise(peer_id, reason, n)

    def introducer(self, origin: str) -> tuple[str, str]:
        """(connection, subnet) that introduced gossip origin `origin` here (admission.py):
        the verifier serves its probation senders fairly per introducing connection and
        subnet, so fresh keys brought over one connection share one connection's turn. Any
        thread."""
        return self.admission.introducer(origin)

    def set_established(self, fn: Callable[[str], bool]) -> None:
        """`fn(peer_id) -> bool`: True for peers with a verified history here. Their gossip
        skips the node's fair-share budget (admission.py) and they may use the bulk plane's
        reserve of connections. Fast and thread-safe (a set lookup)."""
        self.admission.set_established(fn)
        self.bulk.add_known(fn)

    def set_peer_filter(self, fn: Callable[[str], bool] | None) -> None:
        """`fn(peer_id) -> bool`: False drops that peer's gossip (at the validator, counted
        as `banned`) and refuses its requests and streams. Called from the libp2p thread:
        it must be fast and thread-safe (e.g. a set lookup)."""
        self._ctx.peer_filter = fn

    # The Transport interface (node/p2p/__init__.py): the work is in the services --------

    @property
    def reachability(self) -> Reachability:
        """Is this node reachable from the internet (reachability.py)? `.public` is True
        only once a peer dialled us back at an advertised address."""
        return self.reach.current

    def on_reachability_change(self, fn: Callable[[Reachability], None]) -> Callable[[], None]:
        """Call `fn(snapshot)` on the asyncio loop whenever the verdict or the addresses
        change; returns a function that unsubscribes."""
        return self.reach.subscribe(fn)

    def topic(self, kind: str) -> str:
        return self.gossip.topic(kind)

    async def subscribe(self, kind: str, handler: Handler) -> None:
        """See GossipService.subscribe."""
        await self.gossip.subscribe(kind, handler)

    async def publish(self, kind: str, message: WireModel) -> None:
        """See GossipService.publish."""
        await self.gossip.publish(kind, message)

    def set_stream_handler(self, protocol_id: str, handler: StreamHandler, *,
                           max_inbound: int | None = None) -> Awaitable[None]:
        """See RequestService.set_stream_handler."""
        return self.requests.set_stream_handler(protocol_id, handler, max_inbound=max_inbound)

    def set_request_handler(self, protocol_id: str, handler: RequestHandler) -> Awaitable[None]:
        """See RequestService.set_request_handler."""
        return self.requests.set_request_handler(protocol_id, handler)

    async def open_stream(self, peer_id: str, protocol_id: str,
                          timeout: float | None = None) -> AsyncStream:
        return await self.requests.open_stream(peer_id, protocol_id, timeout)

    async def request(self, peer_id: str, protocol_id: str, payload: bytes,
                      timeout: float | None = None, *, max_response: int | None = None) -> bytes:
        """See RequestService.request."""
        return await self.requests.request(peer_id, protocol_id, payload, timeout,
                                           max_response=max_response)

    async def provide(self, key: bytes) -> bool:
        """See DHTService.provide."""
        return await self.dht.provide(key)

    async def find_providers(self, key: bytes, count: int = 20) -> list[tuple[str, list[str]]]:
        """See DHTService.find_providers."""
        return await self.dht.find_providers(key, count)

    def protect(self, peer_id: str, tag: str) -> None:
        """Keep the connection to `peer_id` when trimming to `p2p.max_peers` (e.g. the
        trainer this node follows), until `unprotect(peer_id, tag)`."""
        self.connmgr.protect(peer_id, tag)

    def unprotect(self, peer_id: str, tag: str) -> bool:
        """Drop one protection tag; True if another tag still protects the peer."""
        return self.connmgr.unprotect(peer_id, tag)

    def set_followed(self, fn: Callable[[str], bool] | None) -> None:
        """`fn(peer_id) -> bool`: True for the trainers this node follows; their manifests
        and adverts are never throttled by their publication rate (admission.py). Fast and
        thread-safe (a set lookup)."""
        self.admission.set_followed(fn)

    def _cut(self, peer: str) -> None:
        self.metrics.inc("peers_cut")
        self.discovery.forget(peer)
        try:
            self._ctx.bridge.call_soon(self._t_disconnect_soon, peer)
        except NotRunning:
            pass

    def _t_disconnect_soon(self, peer: str) -> None:
        nursery = self._ctx.nursery
        if nursery is not None:
            nursery.start_soon(self._t_disconnect, peer)

    async def _t_disconnect(self, peer: str) -> None:
        await t_close_peer(self._ctx.host, ID.from_base58(peer))

    def _t_stream_fault(self, peer: str, protocol_id: str, error: BaseException) -> None:
        self.metrics.inc("stream_faults")
        log.warning("stream %s from %s raised %s: %s (stream reset, peer penalised)",
                    protocol_id, peer, type(error).__name__, str(error)[:200])
        self.penalties.penalise(peer, "stream_fault")

    def _t_window_violation(self, peer: str, nbytes: int) -> None:
        self.metrics.inc("window_violations")
        self.penalties.penalise(peer, "window_violation")

    async def _trio_main(self, started, listen: list[multiaddr.Multiaddr]) -> None:
        ctx = self._ctx
        key_pair = self.identity.to_libp2p_keypair()
        noise = NoiseTransport(key_pair, noise_privkey=create_x25519_key_pair().private_key)
        host = new_host(key_pair=key_pair,
                        sec_opt={NOISE_PROTOCOL_ID: noise},
                        muxer_opt={YAMUX_PROTOCOL_ID: Yamux},
                        listen_addrs=listen)
        # One attempt per dial: discovery.py retries with its own backoff and reports why.
        host.get_network().retry_config.max_retries = 0
        patches.install()  # the py-libp2p version gate and the process-wide patches
        # before pubsub adds its handlers; new inbound connections per subnet at accept
        patches.patch_host(host, self._t_stream_fault, self.admission.accept_gate.t_admit)
        router, pubsub = build_gossip(host, self.cfg, self.metrics, self._t_stream_fault)
        ctx.host, ctx.router, ctx.pubsub = host, router, pubsub
        host.get_network().register_notifee(_Notifee(self._t_connected, self._t_disconnected))
        services = self.relay.t_services(host)
        dht = self.dht.t_service(host)
        if dht is not None:
            services.append(dht)
        try:
            async with (host.run(listen_addrs=listen), background_trio_service(pubsub),
                        background_trio_service(router), AsyncExitStack() as stack):
                for service in services:
                    await stack.enter_async_context(background_trio_service(service))
                self.relay.t_guard_hop(host)
                await pubsub.wait_until_ready()
                patches.patch_running_pubsub(pubsub, self.admission.admit,
                                             self.validation_queue)
                ctx.listen_addrs = _dialable(host.get_addrs())
                self.requests.t_install_all()
                async with trio.open_nursery() as nursery:
                    ctx.nursery = nursery
                    started(nursery)
                    await ctx.bridge.stop_event.wait()
                    nursery.cancel_scope.cancel()
                ctx.nursery = None
                # Quiesce before the services stop: closing under load otherwise
                # raises "Nursery is closed to new arrivals" inside py-libp2p.
                with trio.move_on_after(SHUTDOWN_QUIESCE_S):
                    async with trio.open_nursery() as closing:  # one dead peer holds no other
                        for peer in list(host.get_connected_peers()):
                            closing.start_soon(t_close_peer, host, peer)
                    await trio.sleep(0.05)
        finally:
            # Pubsub's seen-message cache owns a sweeper thread; stop it (none left behind).
            pubsub.seen_messages.stop()

    # Connections ----------------------------------------------------------------------

    async def connect(self, addr: str, timeout: float | None = None) -> str:
        """Dial a full multiaddr (with /p2p/<peer id>); returns the peer ID.
        Raises DialError naming the address and why (refused, timeout, wrong peer ID,
        protocol mismatch)."""
        info = info_from_p2p_addr(_parse_maddr(addr, need_peer=True))
        timeout = self.cfg.dial_timeout_s if timeout is None else timeout
        self.metrics.inc("dials")
        try:
            await self._ctx.bridge.call(self._t_connect, info, timeout)
        except NotRunning:
            raise
        except Exception as e:
            self.metrics.inc("dial_failures")
            reason = e.reason if isinstance(e, DialError) else "dial_failed"
            raise DialError(f"{addr}: {describe_dial_error(e)}", reason=reason) from e
        return info.peer_id.to_base58()

    async def _t_connect(self, info, timeout: float) -> None:
        # Dial exactly this address (not every address the peerstore holds for the peer), so
        # a failure can be attributed to it.
        host = self._ctx.host
        network = host.get_network()
        host.peerstore.add_addrs(info.peer_id, info.addrs, 3600)
        circuit = "/p2p-circuit" in str(info.addrs[0])
        pending = self._dialing.get(info.peer_id)
        # One dial per peer at a time (a second connection is waste), except a circuit dial
        # beside a direct one: the direct dial of a NAT'd peer (its private address) waits
        # out the whole timeout, and the relay slot it took meanwhile reaches it now.
        if pending is not None and not (circuit and not pending[1]):
            with trio.move_on_after(timeout):
                await pending[0].wait()
        if network.connections.get(info.peer_id):
            return
        done = trio.Event()
        mine = self._dialing[info.peer_id] = (done, circuit)
        try:
            with trio.fail_after(timeout):
                if circuit:
                    full = info.addrs[0].encapsulate(multiaddr.Multiaddr(f"/p2p/{info.peer_id}"))
                    await self.relay.t_dial_circuit(full, info.peer_id)
                    return
                conn = await network.dial_addr(info.addrs[0], info.peer_id)
                started = getattr(conn, "event_started", None)
                if started is not None:
                    await started.wait()
        except trio.TooSlowError:
            raise DialError(f"timed out after {timeout:.0f}s", reason="timeout") from None
        finally:
            done.set()
            if self._dialing.get(info.peer_id) is mine:
                del self._dialing[info.peer_id]

    def connected_peers(self) -> list[str]:
        """Connected members of this swarm (a peer of another swarm, refused by us or
        refusing us, is not one while its connection closes)."""
        d = self.discovery
        if not d.strays and not d.refused_by:
            return sorted(self._connected)
        return sorted(p for p in self._connected if not d.is_stray(p) and p not in d.refused_by)

    async def disconnect(self, peer_id: str) -> None:
        host = self._ctx.host
        if host is None:
            raise NotRunning("the libp2p host is not running")
        await self._ctx.bridge.call(t_close_peer, host, ID.from_base58(peer_id))

    def peer_ip(self, peer: str) -> str | None:
        """The IP of a live libp2p connection to `peer` (a snapshot read from asyncio)."""
        host = self._ctx.host
        if host is None:
            return None
        try:
            for conn in list(host.get_network().get_connections(ID.from_base58(peer))):
                addr = conn.muxed_conn.get_remote_address()
                if addr:
                    return str(addr[0])
        except Exception as e:  # noqa: BLE001 - no address: the libp2p path is used
            log.debug("no remote address for %s: %s", peer, e)
        return None

    def is_relayed(self, peer_id: str) -> bool:
        """True if every connection to `peer_id` goes through a relay (`/p2p-circuit`)."""
        return peer_id in self._connected and peer_id not in self._direct_addr

    def direct_addr_of(self, peer_id: str) -> str | None:
        """The remote address of a direct connection to `peer_id` (None if relayed only)."""
        return self._direct_addr.get(peer_id)

    def advertised_addrs(self) -> list[str]:
        """Addresses others should dial us at, full (with /p2p/<us>): our relayed
        (`/p2p-circuit`) addresses first while we are not public, then the listen ones."""
        snap = self.reach.current
        circuits = [] if snap.public else list(snap.relay_addrs)
        return list(dict.fromkeys(circuits + self.listen_addrs))

    # Connection tracking (called in the trio thread) -----------------------------------

    def _t_connected(self, conn) -> None:
        peer = conn.muxed_conn.peer_id.to_base58()
        patches.patch_connection(conn.muxed_conn, peer, self._t_window_violation)
        if self.penalties.refused(peer):
            self.metrics.inc("connections_refused")
            self._t_disconnect_soon(peer)
            return
        if not self.admission.connected(peer, _remote_ip(conn.muxed_conn)):
            self.metrics.inc("connections_refused_subnet")
            self._t_disconnect_soon(peer)
            return
        self._t_peers_changed()

    def _t_disconnected(self, network, conn) -> None:
        peer = conn.muxed_conn.peer_id
        if not network.connections.get(peer):
            self.admission.disconnected(peer.to_base58())
        self._t_peers_changed()

    def _t_peers_changed(self) -> None:
        ctx = self._ctx
        conns = ctx.host.get_network().connections
        self.dht.t_connections_changed(ctx.nursery, [p for p, cs in conns.items() if cs])
        peers, direct, outbound = set(), {}, set()
        for pid, cs in list(conns.items()):
            if not cs:
                continue
            p = pid.to_base58()
            peers.add(p)
            for c in cs:
                addr = connection_addr(c)
                if addr is not None:
                    direct.setdefault(p, addr)
                    if str(getattr(c, "direction", "")) == "outbound":
                        outbound.add(p)
        ctx.bridge.to_asyncio_nowait(self._set_connected, peers, direct, outbound)

    def _set_connected(self, peers: set[str], direct: dict[str, str] | None = None,
                       outbound: set[str] | None = None) -> None:
        new = peers - self._connected
        self._connected = peers
        self._direct_addr = dict(direct or {})
        self._outbound = set(outbound or ())
        self.connmgr.peers_changed(peers)
        if new:
            self.discovery.peers_connected(new)
            self.gossip.peers_connected(new)


def _log_reachability(snap: Reachability) -> None:
    level = logging.WARNING if snap.verdict is Verdict.UNREACHABLE else logging.INFO
    log.log(level, "%s", snap.line())


class _Notifee(ConnectionNotifee):
    """py-libp2p network notifee: hands connection events to the node (libp2p thread)."""

    def __init__(self, connected: Callable[[object], None],
                 disconnected: Callable[[object, object], None]):
        self.on_connected = connected
        self.on_disconnected = disconnected

    async def connected(self, network, conn) -> None:
        self.on_connected(conn)

    async def disconnected(self, network, conn) -> None:
        self.on_disconnected(network, conn)


def _remote_ip(muxed_conn) -> str | None:
    try:
        addr = muxed_conn.get_remote_address()
    except Exception:  # noqa: BLE001 - no address: the "?" subnet
        return None
    return str(addr[0]) if addr else None


def _parse_maddr(addr: str, *, need_peer: bool) -> multiaddr.Multiaddr:
    try:
        m = multiaddr.Multiaddr(addr)
    except Exception as e:  # noqa: BLE001 - multiaddr raises several types
        raise BadMultiaddr(f"{addr!r} is not a valid multiaddr ({e})") from None
    if need_peer and "/p2p/" not in str(m):
        raise BadMultiaddr(f"{addr} lacks the /p2p/<peer id> part (copy the full address "
                           "the other node printed)")
    return m


def _dialable(addrs) -> list[str]:
    """Full multiaddrs others can dial: 0.0.0.0 expands to this machine's addresses."""
    out: list[str] = []
    for a in addrs:
        s = str(a)
        if "/ip4/0.0.0.0/" in s:
            for ip in _local_ips():
                out.append(s.replace("/ip4/0.0.0.0/", f"/ip4/{ip}/"))
        else:
            out.append(s)
    return list(dict.fromkeys(out))


def _local_ips() -> list[str]:
    """Loopback, the host name's IPv4 addresses and the default route's: on most Linux
    installs the host name resolves to 127.0.1.1 only, and a node listening on 0.0.0.0
    would otherwise tell its peers loopback addresses alone (#29 audit)."""
    ips = ["127.0.0.1"]
    try:
        for info in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET):
            ips.append(info[4][0])
    except OSError:
        pass
    if (ip := route_ip()) is not None:
        ips.append(ip)
    return list(dict.fromkeys(ips))


def route_ip() -> str | None:
    """This machine's IPv4 address on its default route (asked of the kernel's routing
    table: connecting a UDP socket sends nothing), or None without such a route."""
    for probe in ("8.8.8.8", "10.254.254.254"):
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect((probe, 9))
                ip = s.getsockname()[0]
        except OSError:
            continue
        if ip and not ip.startswith(("127.", "0.")):
            return ip
    return None


def describe_dial_error(e: BaseException) -> str:
    """One line saying why a dial failed, for operators."""
    seen: list[BaseException] = []
    todo: list[BaseException] = [e]
    while todo:
        cur = todo.pop()
        if cur in seen:
            continue
        seen.append(cur)
        todo.extend(x for x in (cur.__cause__, cur.__context__) if x is not None)
        if isinstance(cur, BaseExceptionGroup):
            todo.extend(cur.exceptions)
    blob = " | ".join(f"{type(x).__name__}: {x}" for x in seen)
    low = blob.lower()
    if isinstance(e, DialError) and e.reason == "timeout":
        return f"{e} (host down, firewall, or wrong IP/port?)"
    if "connectionrefused" in low or "refused" in low:
        return ("connection refused (nothing listening there: is the node running, is the "
                "port right?)")
    if "peeridmismatches" in low or "peer id does not correspond" in low:
        actual = ""
        if "remote_peer_id_from_pubkey=" in blob:
            actual = " (it is " + blob.split("remote_peer_id_from_pubkey=", 1)[1].split()[0] + ")"
        return f"wrong peer ID: the node at that address has another identity{actual}"
    if "negotiate" in low or "multiselect" in low or "handshake" in low or "protocol" in low:
        return ("protocol mismatch: the other side did not complete Noise + Yamux (not a "
                "swarm-node/libp2p peer, or an incompatible version?)")
    if "timed out" in low or "timeout" in low:
        return "timed out (host down, firewall, or wrong IP/port?)"
    if "unreachable" in low or "no route" in low:
        return "network unreachable (check the IP address and your network)"
    return f"{type(e).__name__}: {e}"


def _flatten(e: BaseException) -> str:
    """Leaf errors of a (possibly nested) exception group, one line."""
    if isinstance(e, BaseExceptionGroup):
        return "; ".join(_flatten(x) for x in e.exceptions)
    return f"{type(e).__name__}: {e}"
