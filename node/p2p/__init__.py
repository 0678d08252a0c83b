"""Peer-to-peer layer: a py-libp2p host (trio, in its own thread) behind an asyncio API.

Other packages use this package interface only (an import contract holds it): `Transport`,
what roles and the broadcaster type against, which `P2PNode` implements (and
node/testing/transport.py's in-memory `FakeTransport` for unit tests), the errors, and the
bulk plane's types the broadcaster routes shards over. Nothing outside this package imports
trio, and importing it imports neither libp2p nor trio (keeps `--help` fast).
"""

from __future__ import annotations

import importlib
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol

from .errors import (
    BootstrapError,
    DialError,
    NotRunning,
    P2PError,
    PublishError,
    RequestError,
    StreamError,
)

if TYPE_CHECKING:
    from ...protocol.envelope import Envelope
    from ...protocol.messages import WireModel
    from ..identity import Identity
    from .bulk import BulkPlane
    from .reachability import Reachability

__all__ = [
    "BootstrapError",
    "BulkBusy",
    "BulkConn",
    "BulkError",
    "BulkUnavailable",
    "DialError",
    "IdlePool",
    "NotRunning",
    "P2PError",
    "P2PMetrics",
    "P2PNode",
    "PublishError",
    "Reachability",
    "RequestError",
    "StreamError",
    "Transport",
    "Verdict",
    "route_ip",
]

GossipHandler = Callable[["Envelope", str], Awaitable[None]]  # (verified envelope, from peer)
RequestHandler = Callable[[str, bytes], Awaitable[bytes]]  # (peer, request) -> response
StreamHandler = Callable[[Any, str], Awaitable[None]]  # (stream, peer)


class Transport(Protocol):
    """A swarm peer as roles and the broadcaster use it. Peers are base58 peer IDs; gossip
    kinds are the protocol's topic kinds ("rollouts", "verdicts", "checkpoints", ...). A
    superset of node/metrics.py's `Transport` (what the node state reads: `metrics`,
    `connected_peers`, `health`), which stays there to keep that module off this one."""

    identity: Identity
    peer_id: str
    metrics: Any  # P2PMetrics: `.counters` {name: n}, `.inc(name, n)`
    bulk: BulkPlane | None  # shards and gossip bodies over TLS beside libp2p; None: none

    @property
    def listen_addrs(self) -> list[str]: ...

    # Gossip: signed envelopes on the swarm's topics
    def topic(self, kind: str) -> str: ...

    async def subscribe(self, kind: str, handler: GossipHandler) -> None: ...

    async def publish(self, kind: str, message: WireModel) -> None: ...

    # Streams and request/response (protocol IDs from protocol/ids.py)
    def set_stream_handler(self, protocol_id: str, handler: StreamHandler, *,
                           max_inbound: int | None = None) -> Awaitable[None]: ...

    def set_request_handler(self, protocol_id: str,
                            handler: RequestHandler) -> Awaitable[None]: ...

    async def open_stream(self, peer_id: str, protocol_id: str,
                          timeout: float | None = None) -> Any: ...

    async def request(self, peer_id: str, protocol_id: str, payload: bytes,
                      timeout: float | None = None, *,
                      max_response: int | None = None) -> bytes: ...

    # Peers, reachability, provider records
    def connected_peers(self) -> list[str]: ...

    @property
    def reachability(self) -> Reachability: ...

    def on_reachability_change(self, fn: Callable[[Reachability], None]
                               ) -> Callable[[], None]: ...

    async def provide(self, key: bytes) -> bool: ...

    async def find_providers(self, key: bytes,
                             count: int = 20) -> list[tuple[str, list[str]]]: ...

    def protect(self, peer_id: str, tag: str) -> None: ...

    def unprotect(self, peer_id: str, tag: str) -> bool: ...

    # How peers are treated
    def report_misbehaviour(self, peer_id: str, n: int = 1,
                            reason: str = "bogus_batch") -> bool: ...

    def introducer(self, origin: str) -> tuple[str, str]: ...

    def set_peer_filter(self, fn: Callable[[str], bool] | None) -> None: ...

    def set_established(self, fn: Callable[[str], bool]) -> None: ...

    def set_followed(self, fn: Callable[[str], bool] | None) -> None: ...

    def health(self) -> dict[str, Any]: ...


_LAZY = {  # name -> submodule: importing the package must not import libp2p/trio
    "P2PNode": "host",
    "route_ip": "host",
    "BulkBusy": "bulk",
    "BulkConn": "bulk",
    "BulkError": "bulk",
    "BulkUnavailable": "bulk",
    "IdlePool": "bulk",
    "P2PMetrics": "metrics",
    "Reachability": "reachability",
    "Verdict": "reachability",
}


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(name)
