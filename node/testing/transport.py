"""An in-memory `Transport` (node/p2p) for unit tests of roles and the broadcaster: the
seam's fake ships with it (tests/node/p2p/test_transport.py checks that it and `P2PNode`
have the interface's members with the same parameters).

Members of one `FakeNetwork` reach each other: a publish is sealed with the sender's
identity and handed, opened, to every other member subscribed to the kind (like GossipSub,
never back to the sender); a request or stream goes to the handler the named peer set.
Peer filters and penalties apply as on a real node (a refused peer's gossip and requests
are dropped). What a test wants to look at is recorded: `published`, `reports`,
`protected`, `provided`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from ...protocol.envelope import Envelope, open_envelope
from ...protocol.messages import WireModel
from ..identity import Identity
from ..p2p import P2PMetrics, Reachability, RequestError, StreamError


async def _nothing() -> None:
    return None


class FakeNetwork:
    """The members that reach each other, by peer ID."""

    def __init__(self) -> None:
        self.members: dict[str, FakeTransport] = {}

    def join(self, identity: Identity | None = None) -> FakeTransport:
        node = FakeTransport(identity or Identity.generate(), self)
        self.members[node.peer_id] = node
        return node


class FakeTransport:
    """One member (see the module doc). `bulk` is None: shards go over streams."""

    def __init__(self, identity: Identity, network: FakeNetwork | None = None):
        self.identity = identity
        self.peer_id = identity.peer_id
        self.network = network if network is not None else FakeNetwork()
        self.network.members.setdefault(self.peer_id, self)
        self.metrics = P2PMetrics()
        self.bulk = None
        self.listen_addrs: list[str] = []
        self.reachability = Reachability()
        self.published: list[tuple[str, WireModel]] = []
        self.subscriptions: dict[str, list[Callable[[Envelope, str], Awaitable[None]]]] = {}
        self.request_handlers: dict[str, Callable[[str, bytes], Awaitable[bytes]]] = {}
        self.stream_handlers: dict[str, Callable[[Any, str], Awaitable[None]]] = {}
        self.reports: list[tuple[str, int, str]] = []
        self.protected: dict[str, set[str]] = {}
        self.provided: set[bytes] = set()
        self.peer_filter: Callable[[str], bool] | None = None
        self.established: Callable[[str], bool] | None = None
        self.followed: Callable[[str], bool] | None = None
        self._watchers: list[Callable[[Reachability], None]] = []

    def allowed(self, peer: str) -> bool:
        return self.peer_filter is None or bool(self.peer_filter(peer))

    def topic(self, kind: str) -> str:
        return f"fake/{kind}"

    async def subscribe(self, kind: str, handler: Callable[[Envelope, str], Awaitable[None]]
                        ) -> None:
        self.subscriptions.setdefault(kind, []).append(handler)

    async def publish(self, kind: str, message: WireModel) -> None:
        self.published.append((kind, message))
        self.metrics.inc("published")
        sealed = self.identity.seal(message)
        for peer, member in list(self.network.members.items()):
            if peer == self.peer_id or not member.allowed(self.peer_id):
                continue
            for handler in list(member.subscriptions.get(kind, [])):
                member.metrics.inc("delivered")
                await handler(open_envelope(sealed, expected_sender=self.peer_id), self.peer_id)

    def set_stream_handler(self, protocol_id: str, handler, *,
                           max_inbound: int | None = None) -> Awaitable[None]:
        self.stream_handlers[protocol_id] = handler
        return _nothing()

    def set_request_handler(self, protocol_id: str, handler) -> Awaitable[None]:
        self.request_handlers[protocol_id] = handler
        return _nothing()

    def _member(self, peer_id: str, what: str, error: type[Exception]) -> FakeTransport:
        member = self.network.members.get(peer_id)
        if member is None or not member.allowed(self.peer_id):
            raise error(f"{what} to {peer_id}: not connected", reason="unreachable")
        return member

    async def open_stream(self, peer_id: str, protocol_id: str,
                          timeout: float | None = None) -> Any:
        """A pair of in-memory streams: ours is returned, the other goes to the peer's
        handler (asyncio StreamReader/Writer-like: read, readexactly, write, close)."""
        member = self._member(peer_id, protocol_id, StreamError)
        handler = member.stream_handlers.get(protocol_id)
        if handler is None:
            raise StreamError(f"{peer_id} does not serve {protocol_id}", reason="protocol")
        ours, theirs = _stream_pair()
        asyncio.get_running_loop().create_task(handler(theirs, self.peer_id))
        return ours

    async def request(self, peer_id: str, protocol_id: str, payload: bytes,
                      timeout: float | None = None, *, max_response: int | None = None
                      ) -> bytes:
        member = self._member(peer_id, protocol_id, RequestError)
        handler = member.request_handlers.get(protocol_id)
        if handler is None:
            raise RequestError(f"{peer_id} does not serve {protocol_id}", reason="protocol")
        self.metrics.inc("requests_sent")
        response = await asyncio.wait_for(handler(self.peer_id, bytes(payload)), timeout)
        if max_response is not None and len(response) > max_response:
            raise RequestError(f"{protocol_id} response of {len(response)} bytes from "
                               f"{peer_id} is over {max_response}", reason="too_large")
        return response

    def connected_peers(self) -> list[str]:
        return sorted(p for p in self.network.members if p != self.peer_id)

    def on_reachability_change(self, fn: Callable[[Reachability], None]
                               ) -> Callable[[], None]:
        self._watchers.append(fn)
        return lambda: self._watchers.remove(fn)

    def set_reachability(self, snap: Reachability) -> None:
        """Test hook: a new verdict, told to the watchers as the node's tracker does."""
        self.reachability = snap
        for fn in list(self._watchers):
            fn(snap)

    async def provide(self, key: bytes) -> bool:
        self.provided.add(key)
        return True

    async def find_providers(self, key: bytes, count: int = 20) -> list[tuple[str, list[str]]]:
        return [(p, list(m.listen_addrs)) for p, m in self.network.members.items()
                if p != self.peer_id and key in m.provided][:count]

    def protect(self, peer_id: str, tag: str) -> None:
        self.protected.setdefault(peer_id, set()).add(tag)

    def unprotect(self, peer_id: str, tag: str) -> bool:
        tags = self.protected.get(peer_id, set())
        tags.discard(tag)
        if not tags:
            self.protected.pop(peer_id, None)
        return bool(tags)

    def report_misbehaviour(self, peer_id: str, n: int = 1, reason: str = "bogus_batch"
                            ) -> bool:
        self.reports.append((peer_id, n, reason))
        return False

    def introducer(self, origin: str) -> tuple[str, str]:
        return origin, "?"  # one hop: every origin its own connection

    def set_peer_filter(self, fn: Callable[[str], bool] | None) -> None:
        self.peer_filter = fn

    def set_established(self, fn: Callable[[str], bool]) -> None:
        self.established = fn

    def set_followed(self, fn: Callable[[str], bool] | None) -> None:
        self.followed = fn

    def health(self) -> dict[str, Any]:
        return {"alive": True, "peers": len(self.connected_peers())}


class _MemoryStream:
    """One end of an in-memory byte stream."""

    def __init__(self, inbox: asyncio.StreamReader, outbox: asyncio.StreamReader):
        self._inbox, self._outbox = inbox, outbox

    async def read(self, n: int = -1) -> bytes:
        return await self._inbox.read(n)

    async def readexactly(self, n: int) -> bytes:
        return await self._inbox.readexactly(n)

    async def write(self, data: bytes) -> None:
        self._outbox.feed_data(bytes(data))

    async def close(self) -> None:
        if not self._outbox.at_eof():
            self._outbox.feed_eof()

    async def reset(self) -> None:
        await self.close()


def _stream_pair() -> tuple[_MemoryStream, _MemoryStream]:
    a_to_b, b_to_a = asyncio.StreamReader(), asyncio.StreamReader()
    return _MemoryStream(b_to_a, a_to_b), _MemoryStream(a_to_b, b_to_a)
