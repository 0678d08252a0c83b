"""Patch: py-libp2p 0.8.1 Circuit Relay v2 hop service (`CircuitV2Protocol`).

Two faults of the relay side, both found here (not reported upstream as of 0.8.1; #1537 /
PR #1538, which 0.8.1 contains, fixed the wire format and DCUtR, not these):

1. One circuit's end closes another circuit. The hop handler keeps the streams of a
   circuit in `_active_relays`, keyed by the *peer* (source, then destination), and each
   relay direction's `finally` closes whatever streams that key holds. Two peers reaching
   the same NAT'd peer through one relay share the key: when the first leaves, the relay
   resets the second's circuit (shown by tests/node/p2p/test_relay_patches.py). Fixed by
   closing the two streams of *this* circuit when it ends and keeping no per-peer registry.
2. Slots of departed peers stay taken. `can_accept_reservation` counts every unexpired
   reservation against `max_reservations`, including those of peers that disconnected
   (a reservation is only valid while its peer is connected, as `get_reservation` knows):
   under churn a relay refuses newcomers for the reservation TTL (an hour by default).
   Fixed by dropping reservations of disconnected peers before counting.
3. A reservation for anyone. RESERVE takes the peer id from the message's optional `peer`
   field when present, so a client can take (or refresh) a slot in another peer's name;
   the spec reserves for the connection's peer. Fixed by ignoring the field.

Both are subclasses used per relay (no process-wide replacement). `shape()` lists what no
longer matches the code these were written against (empty: the patch applies)."""

from __future__ import annotations

import inspect

from libp2p.relay.circuit_v2.protocol import CircuitV2Protocol
from libp2p.relay.circuit_v2.resources import RelayResourceManager

UPSTREAM = "none filed; py-libp2p 0.8.1 (checked against the 0.8.1 wheel)"


class _NoPeerRegistry(dict):
    """`_active_relays` that holds nothing: the upstream `finally` then never closes
    streams by peer key (they are closed per circuit in RelayProtocol._relay_data)."""

    def __setitem__(self, key, value) -> None:
        return None


class RelayReservations(RelayResourceManager):
    """Reservations that free their slot when the peer disconnects (fault 2)."""

    def _clean_expired(self) -> None:
        super()._clean_expired()
        for peer in [p for p in self._reservations if not self._is_peer_connected(p)]:
            del self._reservations[peer]

    def active(self) -> int:
        """Reservations held by connected peers now."""
        self._clean_expired()
        return len(self._reservations)


class RelayProtocol(CircuitV2Protocol):
    """The hop/stop service with both faults fixed."""

    def __init__(self, host, limits=None, allow_hop: bool = False, **timeouts):
        super().__init__(host, limits=limits, allow_hop=allow_hop, **timeouts)
        self._active_relays = _NoPeerRegistry()
        self.resource_manager = RelayReservations(self.limits, self.host)
        self.circuits = 0  # circuits being relayed now (hop side)
        self.circuits_total = 0

    async def _handle_reserve(self, stream, msg) -> None:
        msg.ClearField("peer")  # fault 3: reserve for the connection's own peer
        await super()._handle_reserve(stream, msg)

    async def _relay_data(self, src_stream, dst_stream, peer_id, deadline=None,
                          circuit_data_limit=None) -> None:
        # Both directions of one circuit run this; the first to end closes the circuit's
        # two streams, which ends the other direction (fault 1: never another circuit's).
        self.circuits += 1
        self.circuits_total += 1
        try:
            await super()._relay_data(src_stream, dst_stream, peer_id, deadline,
                                      circuit_data_limit)
        finally:
            self.circuits -= 1
            await self._close_stream(src_stream)
            await self._close_stream(dst_stream)


def shape() -> list[str]:
    """What no longer matches py-libp2p 0.8.1 (empty when the patch applies)."""
    problems = []
    params = list(inspect.signature(CircuitV2Protocol._relay_data).parameters)
    if params != ["self", "src_stream", "dst_stream", "peer_id", "deadline",
                  "circuit_data_limit"]:
        problems.append(f"CircuitV2Protocol._relay_data{params}")
    src = inspect.getsource(CircuitV2Protocol)
    if "self._active_relays[" not in src or "in self._active_relays" not in src:
        problems.append("CircuitV2Protocol no longer keeps _active_relays by peer")
    if 'msg.HasField("peer")' not in inspect.getsource(CircuitV2Protocol._handle_reserve):
        problems.append("CircuitV2Protocol._handle_reserve no longer reads msg.peer")
    if "self.resource_manager = RelayResourceManager(" not in src:
        problems.append("CircuitV2Protocol.resource_manager is built differently")
    for name in ("_clean_expired", "_is_peer_connected", "can_accept_reservation"):
        if not callable(getattr(RelayResourceManager, name, None)):
            problems.append(f"RelayResourceManager.{name} is gone")
    return problems
