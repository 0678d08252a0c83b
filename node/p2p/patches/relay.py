"""Patches: py-libp2p 0.8.1's Circuit Relay v2 hop service (`CircuitV2Protocol`).

Three faults of the relay side, found here (not reported upstream as of 0.8.1; issue #1537
/ PR #1538, which 0.8.1 contains, fixed the wire format and DCUtR, not these):

1. relay_circuit_isolation: one circuit's end closes another circuit. The hop handler keeps
   a circuit's streams in `_active_relays` keyed by *peer* (source, then destination), and
   each relay direction's `finally` closes whatever streams that key holds: two peers
   reaching the same NAT'd peer through one relay share a key, and when the first leaves
   the relay resets the second's circuit. Fixed: `_active_relays` holds nothing and the
   two streams of *this* circuit are closed when it ends.
2. relay_free_departed_slots: slots of departed peers stay taken. `can_accept_reservation`
   counts every unexpired reservation against `max_reservations`, including those of peers
   that disconnected (a reservation is only valid while its peer is connected, as
   `get_reservation` knows): under churn a relay refuses newcomers for the reservation TTL
   (an hour). Fixed: reservations of disconnected peers are dropped before counting.
3. relay_reserve_own_peer: a reservation in anyone's name. RESERVE takes the peer id from
   the message's optional `peer` field when present, so a client can take or refresh a
   slot for another peer; the spec reserves for the connection's peer. Fixed: the field is
   ignored.

All three live in subclasses that relay.py instantiates per host (`RelayProtocol`, whose
resource manager is a `RelayReservations`): nothing process-wide is replaced.
"""

from __future__ import annotations

from libp2p.relay.circuit_v2.protocol import CircuitV2Protocol
from libp2p.relay.circuit_v2.resources import RelayResourceManager

from .registry import Patch, has_attr, has_signature, register, sets_attribute

_PROTO = "libp2p.relay.circuit_v2.protocol:CircuitV2Protocol"
_RES = "libp2p.relay.circuit_v2.resources:RelayResourceManager"
_UPSTREAM = ("none filed (found here against 0.8.1, which already has #1537/#1538's relay "
             "fixes)")

CIRCUITS = register(Patch(
    name="relay_circuit_isolation",
    scope="host",
    targets=(f"{_PROTO}._relay_data (RelayProtocol, per relay)",
             f"{_PROTO}._active_relays (per relay)"),
    why="the end of one relayed circuit resets every other circuit to or from the same peer",
    upstream=_UPSTREAM,
    shape=lambda: (has_signature(CircuitV2Protocol, "_relay_data",
                                 ("self", "src_stream", "dst_stream", "peer_id", "deadline",
                                  "circuit_data_limit"), coroutine=True)
                   + sets_attribute(CircuitV2Protocol, "_active_relays")),
    fingerprints={f"{_PROTO}._relay_data": "280d4dca33c219b8",
                  f"{_PROTO}._handle_connect": "67bbc99668178b31"},
))

SLOTS = register(Patch(
    name="relay_free_departed_slots",
    scope="host",
    targets=(f"{_RES}._clean_expired (RelayReservations, per relay)",),
    why="reservations of peers that left keep their slot until the TTL: newcomers refused",
    upstream=_UPSTREAM,
    shape=lambda: (has_signature(RelayResourceManager, "_clean_expired", ("self",))
                   + has_attr(RelayResourceManager, "_is_peer_connected")
                   + sets_attribute(RelayResourceManager, "_reservations")
                   + sets_attribute(CircuitV2Protocol, "resource_manager")),
    fingerprints={f"{_RES}._clean_expired": "6671674cb4ce2845",
                  f"{_RES}.can_accept_reservation": "fbbec00aa253125a"},
))

RESERVE = register(Patch(
    name="relay_reserve_own_peer",
    scope="host",
    targets=(f"{_PROTO}._handle_reserve (RelayProtocol, per relay)",),
    why="RESERVE honours a peer id named in the message: a slot taken in another's name",
    upstream=_UPSTREAM,
    shape=lambda: has_signature(CircuitV2Protocol, "_handle_reserve",
                                ("self", "stream", "msg"), coroutine=True),
    fingerprints={f"{_PROTO}._handle_reserve": "5a79f679da06bd1f"},
))


class _NoPeerRegistry(dict):
    """`_active_relays` that holds nothing: the upstream `finally` then never closes streams
    by peer key (RelayProtocol._relay_data closes each circuit's own)."""

    def __setitem__(self, key, value) -> None:
        return None


class RelayReservations(RelayResourceManager):
    """Reservations that free their slot when the peer disconnects (relay_free_departed_slots)."""

    def _clean_expired(self) -> None:
        super()._clean_expired()
        for peer in [p for p in self._reservations if not self._is_peer_connected(p)]:
            del self._reservations[peer]

    def active(self) -> int:
        """Reservations held by connected peers now."""
        self._clean_expired()
        return len(self._reservations)


class RelayProtocol(CircuitV2Protocol):
    """The hop/stop service with the three faults fixed; counts its circuits."""

    def __init__(self, host, limits=None, allow_hop: bool = False, **timeouts):
        super().__init__(host, limits=limits, allow_hop=allow_hop, **timeouts)
        self._active_relays = _NoPeerRegistry()
        self.resource_manager = RelayReservations(self.limits, self.host)
        self.circuits = 0  # circuits being relayed now (hop side)
        self.circuits_total = 0

    async def _handle_reserve(self, stream, msg) -> None:
        msg.ClearField("peer")  # relay_reserve_own_peer: the connection's own peer only
        await super()._handle_reserve(stream, msg)

    async def _relay_data(self, src_stream, dst_stream, peer_id, deadline=None,
                          circuit_data_limit=None) -> None:
        # Both directions of a circuit run this; the first to end closes the circuit's two
        # streams, which ends the other (relay_circuit_isolation: never another circuit's).
        self.circuits += 1
        self.circuits_total += 1
        try:
            await super()._relay_data(src_stream, dst_stream, peer_id, deadline,
                                      circuit_data_limit)
        finally:
            self.circuits -= 1
            await self._close_stream(src_stream)
            await self._close_stream(dst_stream)
