"""The dial-back check: "dial me back at my observed IP" (DIALBACK_PROTOCOL).

Why not py-libp2p's AutoNAT: its 0.8.1 server answers a dial request with
`host.connect(peer)`, which returns at once when a connection to the asker exists, and the
request itself arrives on one, so every asker is told it is reachable. Here the answering
peer opens a *fresh* TCP connection to the asker and runs the Noise handshake on it under
a throwaway key, so the asker's identity is checked (a port forwarded to another machine
of the same home does not count) and the probe never becomes a second connection between
the two peers' real identities (nothing for pubsub or discovery to see).

Rules (NODE_SPEC section 3): the answering peer dials only the IP the request came from
(never an address the asker names: no amplification), only over a direct connection (a
relayed asker is answered `relayed`), at most `MAX_PORTS` ports, one probe per asker per
`MIN_INTERVAL_S`, `MAX_CONCURRENT` probes at once.

The asking side asks up to `p2p.dialback_peers` connected peers and feeds the verdict to
the node's ReachabilityTracker: reachable when more peers reached it than failed to.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time

import multiaddr
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.crypto.x25519 import create_new_key_pair as create_x25519_key_pair
from libp2p.peer.id import ID
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
from libp2p.security.noise.transport import Transport as NoiseTransport
from libp2p.transport.upgrader import TransportUpgrader

from ...protocol.errors import ProtocolError
from ...protocol.ids import DIALBACK_PROTOCOL
from ...protocol.messages import DialbackRequest, DialbackResult
from ..lifecycle import wait_set
from .context import HostContext
from .errors import P2PError
from .requests import RequestService

log = logging.getLogger(__name__)

MAX_PORTS = 4
MIN_INTERVAL_S = 10.0  # one probe per asker per this
MAX_CONCURRENT = 4  # probes in flight at once (each is a TCP connect + Noise handshake)
PROBE_TIMEOUT_S = 5.0  # one probe (connect + handshake)
ASK_TIMEOUT_S = MAX_PORTS * PROBE_TIMEOUT_S + 5.0
RETRY_UNKNOWN_S = 5.0  # no answer yet: ask again this soon


class Dialback:
    """Both sides of the dial-back check for one P2PNode."""

    def __init__(self, ctx: HostContext, requests: RequestService):
        self.ctx = ctx
        self.cfg = ctx.cfg
        self.requests = requests
        self._last_probe: dict[str, float] = {}
        # The last probe run for each asker: (reached?, why not). The swarm view says from it
        # whether a peer is public or cannot be dialled (reachability.peer_reach).
        self.probed: dict[str, tuple[bool, str]] = {}
        self._limiter: trio.Semaphore | None = None
        self._upgrader: TransportUpgrader | None = None
        self.checks = 0  # completed checks (tests wait on it)
        self._wake = asyncio.Event()

    def install(self):
        return self.requests.set_request_handler(DIALBACK_PROTOCOL, self._serve)

    def recheck_soon(self) -> None:
        """Run the next check now (e.g. listen addresses or the network changed)."""
        self._wake.set()

    # Answering side ---------------------------------------------------------------------

    async def _serve(self, peer: str, body: bytes) -> bytes:
        req = DialbackRequest.decode(body)
        now = time.monotonic()
        if now - self._last_probe.get(peer, -MIN_INTERVAL_S) < MIN_INTERVAL_S:
            self.ctx.metrics.inc("dialback_refused_rate")
            return DialbackResult(ok=False, reason="rate_limited").encode()
        self._last_probe[peer] = now
        if len(self._last_probe) > 4096:  # bounded: drop the oldest half
            for p, _ in sorted(self._last_probe.items(), key=lambda kv: kv[1])[:2048]:
                del self._last_probe[p]
        result = await self.ctx.bridge.call(self._t_probe, peer, req.ports[:MAX_PORTS])
        if result.reason != "relayed":  # a relayed asker was not probed: no evidence
            self.probed.pop(peer, None)
            self.probed[peer] = (result.ok, result.reason)
            if len(self.probed) > 4096:  # bounded: the oldest answer goes
                del self.probed[next(iter(self.probed))]
        self.ctx.metrics.inc("dialback_served_ok" if result.ok else "dialback_served_failed")
        return result.encode()

    async def _t_probe(self, peer: str, ports: list[int]) -> DialbackResult:
        observed = _t_observed_addr(self.ctx.host, ID.from_base58(peer))
        if observed is None:
            return DialbackResult(ok=False, reason="relayed")
        ip_proto, ip, _port = observed
        seen = f"/{ip_proto}/{ip}/tcp/{_port}"
        if self._limiter is None:
            self._limiter = trio.Semaphore(MAX_CONCURRENT)
        why = ""
        async with self._limiter:
            for port in dict.fromkeys(ports):
                addr = f"/{ip_proto}/{ip}/tcp/{port}"
                why = await self._t_probe_one(addr, ID.from_base58(peer))
                if not why:
                    return DialbackResult(ok=True, addr=addr, observed=seen)
        return DialbackResult(ok=False, observed=seen, reason=why[:128])

    async def _t_probe_one(self, addr: str, peer: ID) -> str:
        """'' when a fresh connection to `addr` completed Noise as `peer`; else why not."""
        maddr = multiaddr.Multiaddr(addr)
        tm = self.ctx.host.get_network().transport_manager
        transport = tm.transport_for_dialing(maddr)
        if transport is None:
            return "no transport"
        raw = None
        try:
            with trio.fail_after(PROBE_TIMEOUT_S):
                raw = await transport.dial(maddr)
                secure = await self._t_upgrader().upgrade_security(raw, True, peer)
                await secure.close()
                raw = None
            return ""
        except trio.TooSlowError:
            return "timeout"
        except Exception as e:  # noqa: BLE001 - any failure is a "no", with its reason
            text = f"{type(e).__name__}: {e}".lower()
            if "mismatch" in text:
                return "another peer answered"
            if "refused" in text or "connect" in text:
                return "connection refused"
            return type(e).__name__
        finally:
            if raw is not None:
                try:
                    await raw.close()
                except Exception as e:  # noqa: BLE001 - best effort
                    log.debug("closing a dial-back probe: %s", e)

    def _t_upgrader(self) -> TransportUpgrader:
        # A throwaway identity: the probe must not look like a second connection of ours.
        if self._upgrader is None:
            key_pair = create_new_key_pair()
            noise = NoiseTransport(key_pair, noise_privkey=create_x25519_key_pair().private_key)
            # Security only: the probe closes once Noise has proven the peer id.
            self._upgrader = TransportUpgrader({NOISE_PROTOCOL_ID: noise}, {})
        return self._upgrader

    # Asking side ------------------------------------------------------------------------

    def listen_ports(self) -> list[int]:
        ports = []
        for a in self.ctx.listen_addrs:
            if "/p2p-circuit" in a or "/tcp/" not in a:
                continue
            try:
                ports.append(int(a.split("/tcp/", 1)[1].split("/", 1)[0]))
            except ValueError:
                continue
        return list(dict.fromkeys(ports))[:MAX_PORTS]

    async def check(self) -> bool | None:
        """Ask up to `p2p.dialback_peers` directly connected peers to dial us back; feed
        the verdict to the tracker. Returns True/False, or None if nobody answered."""
        ports = self.listen_ports()
        peers = [p for p in self.ctx.peers.connected_peers() if not self.ctx.peers.is_relayed(p)]
        if not ports or not peers:
            return None
        random.shuffle(peers)
        asked = peers[:self.cfg.dialback_peers]
        answers = await asyncio.gather(*(self._ask(p, ports) for p in asked))
        results = [r for r in answers if r is not None and r.reason not in _NO_OPINION]
        self.checks += 1
        observed = sorted({r.observed for r in results if r.observed})
        if observed:
            self.ctx.reach.set_observed(observed)
        if not results:
            return None
        oks = [r for r in results if r.ok]
        fails = [r for r in results if not r.ok]
        reachable = len(oks) > len(fails)
        if reachable:
            detail = f"{len(oks)} of {len(results)} peers dialled back"
            self.ctx.reach.set_dialback(True, sorted({r.addr for r in oks}), detail)
        else:
            whys = sorted({r.reason for r in fails})
            detail = f"{len(fails)} of {len(results)} dial-backs failed: {', '.join(whys)}"
            self.ctx.reach.set_dialback(False, [], detail)
        return reachable

    async def _ask(self, peer: str, ports: list[int]) -> DialbackResult | None:
        try:
            body = await self.requests.request(peer, DIALBACK_PROTOCOL,
                                           DialbackRequest(ports=ports).encode(),
                                           timeout=ASK_TIMEOUT_S, max_response=4096)
            return DialbackResult.decode(body)
        except (P2PError, ProtocolError) as e:
            log.debug("dial-back request to %s failed: %s", peer, e)
            return None

    async def run(self) -> None:
        """Check once peers are connected, then every `p2p.reachability_interval_s`
        (every RETRY_UNKNOWN_S while no peer has answered)."""
        while True:
            verdict = None
            try:
                verdict = await self.check()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - one bad round must not end the checks
                log.warning("reachability check failed: %s: %s", type(e).__name__, e)
            wait = (RETRY_UNKNOWN_S if verdict is None
                    else self.cfg.reachability_interval_s)
            self._wake.clear()
            await wait_set(self._wake, wait)


# Peers that had nothing to say about us: not counted either way.
_NO_OPINION = frozenset({"relayed", "rate_limited"})


def _t_observed_addr(host, peer: ID) -> tuple[str, str, int] | None:
    """(ip4|ip6, ip, port) of a direct connection to `peer`, or None if all are relayed."""
    for conn in host.get_network().connections.get(peer, []) or []:
        for a in transport_addrs(conn):
            found = ip_tcp(str(a))
            if found is not None:
                return found
    return None


def transport_addrs(conn) -> list:
    """The real addresses of a connection ([] for one that is closing)."""
    try:
        return list(conn.get_transport_addresses())
    except Exception as e:  # noqa: BLE001 - a closing connection
        log.debug("transport addresses of a closing connection: %s", e)
        return []


def ip_tcp(addr: str) -> tuple[str, str, int] | None:
    """('ip4'|'ip6', ip, port) of a direct /ipX/../tcp/N address, else None."""
    parts = addr.split("/")
    if "p2p-circuit" in parts or len(parts) < 5 or parts[1] not in ("ip4", "ip6") \
            or parts[3] != "tcp":
        return None
    try:
        return parts[1], parts[2], int(parts[4])
    except ValueError:
        return None
