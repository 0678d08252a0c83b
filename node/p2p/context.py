"""What the services of one P2PNode share: the narrow host context.

A service (gossip, requests, discovery, dial-back, relay, DHT, connection manager) gets a
`HostContext`, never the P2PNode: the identity and config, the counters, the penalties, the
reachability tracker, the trio bridge, the node's background tasks, its peer filter, its
connection view (`Peers`), and the live py-libp2p handles, which P2PNode sets in the libp2p
thread once the host runs. Services that need another service (discovery needs the DHT)
take it as a constructor argument; nobody reads another object's private fields.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from ..lifecycle import TaskOwner
from .bridge import TrioBridge
from .metrics import P2PMetrics
from .penalties import PeerPenalties
from .reachability import ReachabilityTracker

if TYPE_CHECKING:  # annotations only: these modules import libp2p
    import trio
    from libp2p.abc import IHost
    from libp2p.pubsub.gossipsub import GossipSub
    from libp2p.pubsub.pubsub import Pubsub

    from ..config import Config, P2PSection
    from ..identity import Identity


class Peers(Protocol):
    """The node's connections as the services see them (P2PNode implements it)."""

    async def connect(self, addr: str, timeout: float | None = None) -> str: ...

    async def disconnect(self, peer_id: str) -> None: ...

    def connected_peers(self) -> list[str]: ...

    def is_relayed(self, peer_id: str) -> bool: ...

    def direct_addr_of(self, peer_id: str) -> str | None: ...

    def advertised_addrs(self) -> list[str]: ...

    def hole_punched_peers(self) -> set[str]: ...


class HostContext:
    """One P2PNode's shared parts. Thread use: the handles (`host`, `pubsub`, `router`,
    `nursery`) only in the libp2p thread (methods named `t_*`/`_t_*`), `tasks` and `peers`
    only on the asyncio loop; `allowed` and the counters from either."""

    def __init__(self, identity: Identity, config: Config, *, metrics: P2PMetrics,
                 bridge: TrioBridge, penalties: PeerPenalties, reach: ReachabilityTracker,
                 peers: Peers):
        self.identity = identity
        self.config = config
        self.peer_id: str = identity.peer_id
        self.limits = config.limits.to_limits()  # message size limits (protocol/limits.py)
        self.metrics = metrics
        self.bridge = bridge
        self.penalties = penalties
        self.reach = reach
        self.peers = peers
        self.tasks = TaskOwner(f"p2p-{self.peer_id[-6:]}")  # cancelled by P2PNode.close
        # `fn(peer) -> bool`: False refuses that peer's gossip, requests and streams (e.g.
        # the trainer's bans). Read from the libp2p thread: fast and thread-safe.
        self.peer_filter: Callable[[str], bool] | None = None
        self.closing = False
        # The live py-libp2p objects, set by P2PNode in the libp2p thread while it runs.
        self.host: IHost | None = None
        self.pubsub: Pubsub | None = None
        self.router: GossipSub | None = None
        self.nursery: trio.Nursery | None = None  # the node's own, inside the libp2p thread
        self.listen_addrs: list[str] = []  # full, dialable (set once the host listens)

    @property
    def cfg(self) -> P2PSection:
        return self.config.p2p

    @property
    def swarm_id(self) -> str:
        return self.config.node.swarm_id

    @property
    def running(self) -> bool:
        return self.bridge.running and not self.closing

    def spawn(self, coro: Any, name: str = "") -> Any:
        """A background task of the node (asyncio), cancelled when it closes."""
        return self.tasks.spawn(coro, name)

    def allowed(self, peer: str) -> bool:
        """Neither refused by the penalties nor by the peer filter."""
        if self.penalties.refused(peer):
            return False
        allow = self.peer_filter
        return allow is None or bool(allow(peer))


class ConnectionNotifee:
    """A py-libp2p network notifee that hears nothing: subclasses override `connected` /
    `disconnected` (the libp2p thread calls them for every connection)."""

    async def connected(self, network, conn) -> None:
        pass

    async def disconnected(self, network, conn) -> None:
        pass

    async def opened_stream(self, network, stream) -> None:
        pass

    async def closed_stream(self, network, stream) -> None:
        pass

    async def listen(self, network, multiaddr) -> None:
        pass

    async def listen_close(self, network, multiaddr) -> None:
        pass
