"""Patch: py-libp2p 0.8.1 closes a connection it has already registered when the dial that
made it is cancelled while the swarm tells its notifees about it.

`Swarm.add_conn` appends the new connection to `swarm.connections` and then awaits
`notify_connected` (every notifee in a nursery of its own). A cancel that reaches the dialing
task in that await lands in add_conn's `except BaseException`, which closes the connection
it has just registered. Whoever cancelled had often done so *because* it saw that
connection: DCUtR's `_perform_hole_punch` dials every address of the peer at once, polls
`_verify_direct_connection` (a look at `swarm.connections`) and cancels the round's other
dials as soon as one direct connection shows; the dial that made it is still notifying. In
the 10-node WAN swarm (2026-12-05, `node.library_log_levels` with the dcutr and swarm
loggers at DEBUG) a cone/cone pair's hole-punched connection was closed this way 0.3 s after
it opened (`[ADDCONN_FAIL] ... Cancelled`), on both sides, and re-punched 19 s later; it was
the last direct close in four runs that benchmarks/swarm_logs.py could not attribute. Any
other dial under a timeout (discovery's) could lose a good connection the same way.

Fixed per host: `notify_connected` runs shielded from cancellation, bounded by
NOTIFY_LIMIT_S, so a registered connection is told to every notifee and kept; the dialer's
cancel takes effect at its next checkpoint after add_conn returns. A notifee that hangs
still ends the wait after NOTIFY_LIMIT_S (upstream would wait forever, uncancelled)."""

from __future__ import annotations

import logging

import trio
from libp2p.network.swarm import Swarm

from .registry import Patch, has_signature, register

log = logging.getLogger(__name__)

# Notifees are in-memory work (pubsub queues the peer, our logs count it): milliseconds.
# The bound only keeps a hung notifee from holding a cancelled dial for ever.
NOTIFY_LIMIT_S = 10.0

PATCH = register(Patch(
    name="connected_kept_on_cancel",
    scope="host",
    targets=("libp2p.network.swarm:Swarm.notify_connected (per host)",),
    why="a dial cancelled while add_conn notifies closes the connection it registered: "
        "DCUtR cancels its other dials once it sees the direct connection, often during "
        "that notify, and lost the hole-punched connection it had just made",
    upstream="none filed (found here against 0.8.1)",
    shape=lambda: (has_signature(Swarm, "notify_connected", ("self", "conn"), coroutine=True)
                   + has_signature(Swarm, "add_conn", ("self", "muxed_conn", "direction"),
                                   coroutine=True)),
))


def patch_connected_shield(network) -> None:
    """`network.notify_connected` runs shielded from its caller's cancellation, at most
    NOTIFY_LIMIT_S."""
    inner = network.notify_connected

    async def notify_connected(conn) -> None:
        with trio.CancelScope(shield=True), trio.move_on_after(NOTIFY_LIMIT_S) as bound:
            await inner(conn)
        if bound.cancelled_caught:
            log.warning("connected notifees still busy after %.0f s: went on without them",
                        NOTIFY_LIMIT_S)

    network.notify_connected = notify_connected
