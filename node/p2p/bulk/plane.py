"""The node's bulk plane (NODE_SPEC 3, "Bulk plane"): one TLS port beside libp2p for the
bytes that are too many for libp2p streams (checkpoint shards, announced gossip bodies),
authenticated by the node's identity both ways. Layers above register a handler per
request kind (`register`) and say which peers are known (`add_known`); the client
(`client`) is shared by every kind.

Where it listens: `bulk.listen` ("auto": the first libp2p listen address's IP, its port +
1; "host:port"; "off"). Where others dial it: `bulk.advertise`, else the bound address if
it is a specific IP (put into shard adverts as `endpoint`), else (a wildcard bind) the IP
peers reach us at over libp2p, with the port from BULK_PROTOCOL. A node that is not
publicly reachable (`reachable()`, NAT) advertises nothing and answers BULK_PROTOCOL with
"none": its peers use libp2p streams to it, while it still dials out to the planes of
public peers.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Awaitable, Callable

from ....protocol.codec import pack, unpack
from ....protocol.errors import ProtocolError
from ....protocol.ids import BULK_PROTOCOL
from ..errors import P2PError
from ..metrics import P2PMetrics
from .cert import server_context
from .client import BulkClient, Endpoint
from .server import BulkServer, Handler

log = logging.getLogger(__name__)

MAX_ANSWER = 300


def listen_address(setting: str, libp2p_listen: list[str]) -> Endpoint | None:
    """(host, port) to bind the plane on, or None (off, or no libp2p TCP address to derive
    it from). ValueError names a malformed setting."""
    if setting == "off":
        return None
    if setting != "auto":
        host, _, port = setting.rpartition(":")
        host = host.strip("[]")
        if not host or not port.isdigit() or int(port) > 65535:
            raise ValueError(f'bulk.listen must be "auto", "off" or "host:port", not '
                             f"{setting!r}")
        return host, int(port)
    for addr in libp2p_listen:
        parts = addr.split("/")
        if (len(parts) >= 5 and parts[1] in ("ip4", "ip6") and parts[3] == "tcp"
                and parts[4].isdigit()):
            port = int(parts[4])
            return parts[2], port + 1 if port else 0
    return None


def _specific(host: str) -> bool:
    try:
        return not ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return True  # a name


class BulkPlane:
    """`allowed(peer)`: the node's peer filter; `request` and `peer_ip` are P2PNode's
    (a libp2p request; the IP of our libp2p connection to a peer)."""

    def __init__(self, identity, cfg, metrics: P2PMetrics, *,
                 allowed: Callable[[str], bool],
                 request: Callable[..., Awaitable[bytes]],
                 peer_ip: Callable[[str], str | None]):
        self.identity, self.cfg, self.metrics = identity, cfg, metrics
        self.allowed, self.request, self.peer_ip = allowed, request, peer_ip
        self.client = BulkClient(identity, cfg, self._query)
        self.server: BulkServer | None = None
        self.bound: Endpoint | None = None
        self.handlers: dict[str, Handler] = {}
        self._known: list[Callable[[str], bool]] = []
        # Whether this node is publicly reachable (P2PNode.reachability, NAT detection):
        # until that exists, every listening node advertises its plane.
        self.reachable: Callable[[], bool] = lambda: True

    def counters(self) -> dict[str, int]:
        """This node's side as a client (connections opened per kind, body reads), for
        /metrics as `swarm_node_bulk_total{name}`; the server's counters are the p2p
        counters `bulk_*`."""
        return self.client.counters()

    def register(self, kind: str, handler: Handler) -> None:
        """Serve connections of `kind` (see BulkServer.register); before or after start."""
        self.handlers[kind] = handler
        if self.server is not None:
            self.server.register(kind, handler)

    def add_known(self, fn: Callable[[str], bool]) -> None:
        """Peers for which `fn(peer)` is true have the server's reserve of connections."""
        self._known.append(fn)

    def known(self, peer: str) -> bool:
        return any(fn(peer) for fn in self._known)

    async def start(self, libp2p_listen: list[str]) -> None:
        where = listen_address(self.cfg.listen, libp2p_listen)
        if where is None:
            log.info("bulk plane off: shards and gossip bodies are served over libp2p "
                     "streams only")
            return
        server = BulkServer(self.identity.peer_id, server_context(self.identity), self.cfg,
                            self.metrics, allowed=self.allowed, known=self.known)
        for kind, handler in self.handlers.items():
            server.register(kind, handler)
        try:
            self.bound = await server.start(*where)
        except OSError as e:
            if self.cfg.listen != "auto":
                raise P2PError(f"bulk.listen {self.cfg.listen!r}: cannot listen: {e}",
                               reason="listen_failed") from e
            log.warning("bulk plane off (cannot listen on %s:%d: %s): shards and gossip "
                        "bodies are served over libp2p streams only", where[0], where[1], e)
            return
        self.server = server
        log.info("bulk plane (shards, gossip bodies; TLS 1.3, peer-id authenticated) on "
                 "%s:%d; open this TCP port beside the libp2p one", *self.bound)

    async def close(self) -> None:
        self.client.close()
        if self.server is not None:
            await self.server.close()
            self.server = None

    # Where others dial us --------------------------------------------------------------

    @property
    def listening(self) -> bool:
        """Whether this node serves a bulk plane at all (off: bulk.listen "off", or it
        could not listen)."""
        return self.server is not None

    def _advertised(self) -> Endpoint | None:
        """(host or "" for "the IP you reach me at", port), or None: no plane to offer."""
        if self.server is None or self.bound is None or not self.reachable():
            return None
        if self.cfg.advertise:
            host, _, port = self.cfg.advertise.rpartition(":")
            return host.strip("[]"), int(port)
        host = self.bound[0]
        return (host if _specific(host) else ""), self.bound[1]

    @property
    def endpoint(self) -> str:
        """"host:port" for shard adverts, "" if there is none to name (no plane, not
        reachable, or a wildcard bind: then peers ask over BULK_PROTOCOL)."""
        where = self._advertised()
        if where is None or not where[0]:
            return ""
        host = f"[{where[0]}]" if ":" in where[0] else where[0]
        return f"{host}:{where[1]}"

    async def serve_query(self, peer: str, body: bytes) -> bytes:
        """BULK_PROTOCOL: msgpack [host, port] (host "": the IP of this libp2p
        connection), or [] for no plane."""
        where = self._advertised()
        return pack([] if where is None else list(where))

    async def _query(self, peer: str) -> Endpoint | None:
        raw = await self.request(peer, BULK_PROTOCOL, b"",
                                 timeout=self.cfg.handshake_timeout_s, max_response=MAX_ANSWER)
        try:
            value = unpack(raw, max_size=MAX_ANSWER)
        except ProtocolError:
            return None
        if value == []:
            return None
        if not (isinstance(value, list) and len(value) == 2 and isinstance(value[0], str)
                and len(value[0]) <= 255 and isinstance(value[1], int)
                and not isinstance(value[1], bool) and 0 < value[1] < 65536):
            return None
        host = value[0] or self.peer_ip(peer)
        return (host, value[1]) if host else None
