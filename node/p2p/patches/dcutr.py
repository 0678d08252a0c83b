"""Patch: py-libp2p 0.8.1's DCUtR waits its whole dial timeout on the direct dial that
starts every attempt.

dcutr_direct_dial_wait: `DCUtRProtocol._try_unilateral_upgrade` (the spec's step 0) dials
the peer's known non-relayed addresses before the hole punch, under `dial_timeout` (10 s
unless given; relay.py passes p2p.dial_timeout_s, 10 s by default). A peer reached through
a relay is behind NAT, and those addresses are its private ones: they answer at once from
its own LAN and never from anywhere else (its router drops the SYN), so every attempt
between two homes first waited the whole timeout: 10 s of the 12.4 s from relay slot to
direct connection in the netlab NAT pair (2026-12-03). Fixed: that first dial waits at most
UNILATERAL_DIAL_S; the hole punch's own dials keep `dial_timeout`.

`DCUtRService` is the subclass relay.py instantiates per host: nothing process-wide is
replaced.
"""

from __future__ import annotations

import logging

import trio
from libp2p.peer.id import ID
from libp2p.relay.circuit_v2.dcutr import DCUtRProtocol

from .registry import Patch, has_attr, has_signature, register

log = logging.getLogger(__name__)

# Enough for an address that answers (the same LAN, a public one): TCP, Noise and Yamux
# take a few round trips, and a lost SYN is sent again after 1 s.
UNILATERAL_DIAL_S = 3.0

_DCUTR = "libp2p.relay.circuit_v2.dcutr:DCUtRProtocol"

DIRECT_DIAL = register(Patch(
    name="dcutr_direct_dial_wait",
    scope="host",
    targets=(f"{_DCUTR}._try_unilateral_upgrade (DCUtRService, per host)",),
    why="each hole-punch attempt first waits the whole dial timeout on a direct dial to a "
        "NAT'd peer's private addresses, which nothing outside its LAN can reach",
    upstream="none filed (found here against 0.8.1)",
    shape=lambda: (has_signature(DCUtRProtocol, "_try_unilateral_upgrade",
                                 ("self", "peer_id"), coroutine=True)
                   + has_attr(DCUtRProtocol, "_dial_peer")
                   + has_attr(DCUtRProtocol, "_verify_direct_connection")),
    fingerprints={f"{_DCUTR}._try_unilateral_upgrade": "0dee46f99e7ce813"},
))


class DCUtRService(DCUtRProtocol):
    """py-libp2p's DCUtR whose first, direct dial waits at most UNILATERAL_DIAL_S."""

    async def _try_unilateral_upgrade(self, peer_id: ID) -> bool:
        # upstream's body with the dials' wait capped (dcutr_direct_dial_wait)
        try:
            addrs = [a for a in self.host.get_peerstore().addrs(peer_id)
                     if "/p2p-circuit" not in str(a)]
        except Exception:  # noqa: BLE001 - as upstream: no addresses, no direct dial
            return False
        if not addrs:
            return False
        try:
            with trio.move_on_after(min(self.dial_timeout, UNILATERAL_DIAL_S)):
                async with trio.open_nursery() as nursery:
                    for addr in addrs:
                        nursery.start_soon(self._dial_peer, peer_id, addr)
        except Exception as e:  # noqa: BLE001 - as upstream: the hole punch follows
            log.debug("direct dial of %s before the hole punch failed: %s", peer_id, e)
        return await self._verify_direct_connection(peer_id)
