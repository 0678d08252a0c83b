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
"""

from __future__ import annotations

import logging

import trio
from libp2p.peer.id import ID

from .patches.internals import transport_under
from .streams import DEAD_CLOSE_S

log = logging.getLogger(__name__)


async def t_close_peer(host, pid: ID, timeout: float = DEAD_CLOSE_S) -> None:
    """Close every connection to `pid`: the transports under them first, then py-libp2p's
    disconnect, each within `timeout`. Errors (already gone) are logged, never raised."""
    for conn in list(host.get_network().connections.get(pid, ()) or ()):
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
