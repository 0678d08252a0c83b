"""Closing connections and streams that may sit on a dead path, bounded (trio side).

py-libp2p's closes and resets write before they let go: a stream's reset or close writes a
yamux frame, a connection's close a yamux GO_AWAY before it closes the socket. On a dead
path (a partition, a stopped peer, a NAT that forgot its mapping) with a full TCP send
buffer, each of those writes waits until TCP gives up (~15 min) or the path comes back, and
so did whatever awaited it: a liveness round, a trim, a penalty's disconnect, a request's
cleanup. Every close or reset of ours on a py-libp2p connection or stream goes through one
of these:
- `t_close_peer` (here): a peer's transports closed first (ends every read and write of the
  connection at once, no frame written), then py-libp2p's disconnect (its bookkeeping, the
  notifees), each bounded by DEAD_CLOSE_S;
- `close_quietly` / `reset_quietly` (streams.py, which patches/handlers.py imports: this
  module imports patches/internals.py): a stream's close or reset, bounded, errors logged.
A write cut off by the bound may leave a partial frame behind: the connection is then of no
further use, which on a path that did not take a dozen bytes in seconds it was not anyway.

Each connection `t_close_peer` closes is marked with why (`closed_by`): the connection log
(relay.py's ConnectionLog, DEBUG) tells our closes from the other side's and py-libp2p's.
"""

from __future__ import annotations

import logging

import trio
from libp2p.peer.id import ID

from .patches.internals import transport_under
from .streams import DEAD_CLOSE_S

log = logging.getLogger(__name__)


CLOSED_BY = "_swarm_node_closed_by"  # attribute set on a connection we close: why


def closed_by(conn) -> str | None:
    """Why this node closed `conn` (t_close_peer's `why`), None if it did not."""
    return getattr(conn, CLOSED_BY, None)


async def t_close_peer(host, pid: ID, timeout: float = DEAD_CLOSE_S, why: str = "") -> None:
    """Close every connection to `pid`: the transports under them first, then py-libp2p's
    disconnect, each within `timeout`. Errors (already gone) are logged, never raised.
    `why` marks the connections (closed_by) for the connection log."""
    conns = list(host.get_network().connections.get(pid, ()) or ())
    for conn in conns:
        try:
            setattr(conn, CLOSED_BY, why or "by this node")
        except AttributeError:  # a connection type without a __dict__: unmarked
            pass
    for conn in conns:
        transport = transport_under(getattr(conn, "muxed_conn", None))
        if transport is None:
            continue
        with trio.move_on_after(timeout):
            try:
                await transport.close()
            except Exception as e:  # noqa: BLE001 - already gone is fine
                log.debug("closing the transport to %s: %s", pid, e)
    with trio.move_on_after(timeout) as scope:
        try:
            await host.disconnect(pid)
        except Exception as e:  # noqa: BLE001 - already gone is fine
            log.debug("disconnect of %s: %s", pid, e)
    if scope.cancelled_caught:
        log.debug("disconnect of %s: not done within %.0fs", pid, timeout)
