"""Reads of py-libp2p private state that 0.8.1 offers no public API for.

Nothing here replaces py-libp2p code (that is what the other modules of this package do):
these functions are the only places outside the patches where swarm-node touches a private
member of a py-libp2p object, so a py-libp2p that renames one shows up here, in
`problems()`, which the version gate checks with the patches (`install`) and
tests/node/p2p/patches/test_registry.py checks on the pinned version.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from libp2p.io.msgio import BaseMsgReadWriter
from libp2p.kad_dht.provider_store import ProviderStore
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo
from libp2p.relay.circuit_v2.dcutr import DCUtRProtocol
from libp2p.relay.circuit_v2.protocol import CircuitV2Protocol
from libp2p.relay.circuit_v2.resources import RelayResourceManager
from libp2p.security.noise.io import BaseNoiseMsgReadWriter
from libp2p.security.secure_session import SecureSession
from libp2p.stream_muxer.yamux.yamux import Yamux

from .registry import has_signature, sets_attribute


def hop_stream_handler(protocol: CircuitV2Protocol) -> Callable[[object], Awaitable[None]]:
    """The relay's own handler of hop streams, for relay.py to put its peer check in front
    (the protocol installs it on the host itself, with no hook)."""
    return protocol._handle_hop_stream


def reservation_holders(resources: RelayResourceManager) -> list[ID]:
    """Peers holding a reservation on this relay (the resource manager lists none)."""
    return list(resources._reservations)


def hole_punch_state(dcutr: DCUtRProtocol) -> tuple[dict[ID, int], set[ID], set[ID]]:
    """A copy of DCUtR's bookkeeping: attempts per peer, peers with an attempt in progress,
    peers upgraded to a direct connection."""
    return (dict(dcutr._hole_punch_attempts), set(dcutr._in_progress),
            set(dcutr._direct_connections))


def providers_from_peer(store: ProviderStore, peer: ID,
                        key: bytes) -> Awaitable[tuple[list[PeerInfo], list[ID]]]:
    """One GET_PROVIDERS query to `peer`: (its providers of `key`, closer peers). dht.py
    walks the network with it: `ProviderStore.find_providers` returns the local records
    alone whenever there are any, and a provider always holds its own."""
    return store._get_providers_from_peer_with_closers(peer, key)


def transport_under(muxed_conn: object) -> object | None:
    """The transport under a connection's Noise session (py-libp2p's RawConnection for TCP,
    a relay stream for a circuit), or None for another shape: closing it ends every read and
    write of the connection at once, where `Yamux.close` first writes a GO_AWAY frame, which
    waits as long as the TCP send buffer stays full (a dead path: until TCP gives up)."""
    noise = getattr(getattr(muxed_conn, "secured_conn", None), "conn", None)
    packets = getattr(noise, "read_writer", None)
    return getattr(packets, "read_write_closer", None)


def problems() -> list[str]:
    """What no longer has the shape these reads expect (empty on the pinned py-libp2p)."""
    return (has_signature(CircuitV2Protocol, "_handle_hop_stream", ("self", "stream"),
                          coroutine=True)
            + sets_attribute(RelayResourceManager, "_reservations")
            + sets_attribute(DCUtRProtocol, "_hole_punch_attempts")
            + sets_attribute(DCUtRProtocol, "_in_progress")
            + sets_attribute(DCUtRProtocol, "_direct_connections")
            + has_signature(ProviderStore, "_get_providers_from_peer_with_closers",
                            ("self", "peer_id", "key"), coroutine=True)
            + sets_attribute(Yamux, "secured_conn")
            + sets_attribute(SecureSession, "conn")
            + sets_attribute(BaseNoiseMsgReadWriter, "read_writer")
            + sets_attribute(BaseMsgReadWriter, "read_write_closer"))
