"""Patches: py-libp2p 0.8.1's DCUtR waits its whole dial timeout on the direct dial that
starts every attempt, and drives its attempts one peer at a time.

dcutr_direct_dial_wait: `DCUtRProtocol._try_unilateral_upgrade` (the spec's step 0) dials
the peer's known non-relayed addresses before the hole punch, under `dial_timeout` (10 s
unless given; relay.py passes p2p.dial_timeout_s, 10 s by default). A peer reached through
a relay is behind NAT, and those addresses are its private ones: they answer at once from
its own LAN and never from anywhere else (its router drops the SYN), so every attempt
between two homes first waited the whole timeout: 10 s of the 12.4 s from relay slot to
direct connection in the netlab NAT pair (2026-12-03). Fixed: that first dial waits at most
UNILATERAL_DIAL_S; the hole punch's own dials keep `dial_timeout`.

dcutr_drive_one_at_a_time: `DCUtRProtocol._auto_drive_loop` awaits each relayed peer's
attempt before it looks at the next, with no bound on an attempt. An attempt that cannot
work (the other side behind a symmetric NAT) takes ~22 s (the direct dial, the exchange,
three 5 s punch rounds 2 s apart) and is made 3 times, so a cone peer relayed to two
symmetric ones reached a cone peer that connected a little later only after ~43 s per
pass: in the 10-node WAN swarm of 2026-12-04 19:46 UTC (main 46e8f92) one cone/cone pair
was still relayed at the end of the steady state, 78 s after the other two went direct.
Fixed: each relayed peer gets its own attempt task (at most DRIVE_PARALLEL at once), each
bounded by ATTEMPT_LIMIT_S; which peers and how often are upstream's (no attempt under way
with it, not direct, fewer than MAX_HOLE_PUNCH_ATTEMPTS made, looked at every DRIVE_EVERY_S).

`DCUtRService` is the subclass relay.py instantiates per host: nothing process-wide is
replaced.
"""

from __future__ import annotations

import logging

import trio
from libp2p.peer.id import ID
from libp2p.relay.circuit_v2.dcutr import MAX_HOLE_PUNCH_ATTEMPTS, DCUtRProtocol

from .registry import Patch, has_attr, has_signature, register

log = logging.getLogger(__name__)

# Enough for an address that answers (the same LAN, a public one): TCP, Noise and Yamux
# take a few round trips, and a lost SYN is sent again after 1 s.
UNILATERAL_DIAL_S = 3.0
DRIVE_EVERY_S = 2.0  # as upstream: how often relayed peers are looked at
DRIVE_PARALLEL = 8  # attempts under way at once (p2p.target_peers is 8)
# One attempt, all of it: ~22 s when the punch fails (21.5-21.7 s traced in the netlab: up
# to 3 s direct dial, the CONNECT/SYNC exchange over the relay, three 5 s rounds 2 s
# apart); its stream reads may wait 30 s each.
ATTEMPT_LIMIT_S = 60.0

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

DRIVE = register(Patch(
    name="dcutr_drive_one_at_a_time",
    scope="host",
    targets=(f"{_DCUTR}._auto_drive_loop (DCUtRService, per host)",),
    why="relayed peers are hole-punched one at a time, each attempt unbounded: ~25 s "
        "failed attempts to symmetric-NAT peers held a cone pair relayed for over a minute",
    upstream="none filed (found here against 0.8.1)",
    shape=lambda: (has_signature(DCUtRProtocol, "_auto_drive_loop", ("self",),
                                 coroutine=True)
                   + has_signature(DCUtRProtocol, "initiate_hole_punch",
                                   ("self", "peer_id"), coroutine=True)),
    fingerprints={f"{_DCUTR}._auto_drive_loop": "17e258dd99ebdc9a"},
))


class DCUtRService(DCUtRProtocol):
    """py-libp2p's DCUtR whose first, direct dial waits at most UNILATERAL_DIAL_S and whose
    attempts run side by side, each bounded."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._driving: set[ID] = set()  # peers with an attempt task of ours

    async def _auto_drive_loop(self) -> None:
        # upstream's choice of peers, each attempt its own task (dcutr_drive_one_at_a_time)
        slots = trio.Semaphore(DRIVE_PARALLEL)
        async with trio.open_nursery() as nursery:
            while True:
                await trio.sleep(DRIVE_EVERY_S)
                for peer_id in self._peers_to_drive():
                    self._driving.add(peer_id)
                    nursery.start_soon(self._drive, peer_id, slots)

    def _peers_to_drive(self) -> list[ID]:
        """Peers reached only through a relay that no attempt is under way with, not known
        to be direct, with attempts left (upstream's rule)."""
        out = []
        connections = getattr(self.host.get_network(), "connections", {}) or {}
        for peer_id, conns in list(connections.items()):
            if (peer_id == self.host.get_id() or peer_id in self._driving
                    or peer_id in self._in_progress or peer_id in self._direct_connections
                    or self._hole_punch_attempts.get(peer_id, 0) >= MAX_HOLE_PUNCH_ATTEMPTS):
                continue
            if any(_relayed(c) for c in (conns if isinstance(conns, list) else [conns])):
                out.append(peer_id)
        return out

    async def _drive(self, peer_id: ID, slots: trio.Semaphore) -> None:
        try:
            async with slots:
                with trio.move_on_after(ATTEMPT_LIMIT_S) as scope:
                    await self.initiate_hole_punch(peer_id)
                if scope.cancelled_caught:
                    log.debug("hole punch with %s cut after %.0f s", peer_id, ATTEMPT_LIMIT_S)
        except Exception as e:  # noqa: BLE001 - as upstream's loop: the next tick retries
            log.debug("hole punch with %s: %s", peer_id, e)
        finally:
            self._driving.discard(peer_id)

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


def _relayed(conn) -> bool:
    try:
        addrs = conn.get_transport_addresses()
    except Exception:  # noqa: BLE001 - as upstream: a connection closing under us
        return False
    return any("/p2p-circuit" in str(a) for a in addrs or ())
