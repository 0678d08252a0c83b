"""Patch: an inbound connection gives its inbound slot back when it closes.

py-libp2p 0.8.1 caps inbound connections with a CapacityLimiter (`Swarm._inbound_limiter`,
max_connections - min_connections = 250 slots). The listener's handler takes a slot, runs
the Noise + yamux upgrade, then parks on `await self.manager.wait_finished()` ("keep handler
alive") and releases the slot only when that returns: when the whole swarm stops. So every
inbound connection ever accepted holds a slot for the life of the node, whether it is still
open or not. After 250 accepted connections (sybils that reconnect after each cut, peers
that redial: a many-identity flood gets there in minutes) every new inbound connection is
closed at accept while the live count is far below the cap: the node refuses every
newcomer (issue #30 item 2) until it restarts. The replacement (per swarm) runs py-libp2p's
handler in a cancel scope that a watcher cancels once the upgraded connection closes, so
the handler returns and the slot is released; the cap then bounds live inbound
connections, as intended. (Pre-multiplexed transports such as QUIC are not used here.)"""

from __future__ import annotations

import contextvars

import trio
from libp2p.network.swarm import Swarm
from libp2p.stream_muxer.yamux.yamux import Yamux

from .registry import Patch, has_signature, register, sets_attribute

PATCH = register(Patch(
    name="inbound_slot_released_on_close",
    scope="host",
    targets=("libp2p.network.swarm:Swarm._handle_inbound_connection (per swarm)",
             "libp2p.network.swarm:Swarm.upgrade_inbound_raw_conn (per swarm)"),
    why="an inbound slot is held until the node stops, not until the connection closes: "
        "after 250 accepted connections every newcomer is refused",
    upstream="none filed (searched 2026-09)",
    shape=lambda: (has_signature(Swarm, "_handle_inbound_connection",
                                 ("self", "read_write_closer", "maddr"), coroutine=True)
                   + has_signature(Swarm, "upgrade_inbound_raw_conn",
                                   ("self", "raw_conn", "maddr"), coroutine=True)
                   + sets_attribute(Swarm, "_inbound_limiter")
                   + sets_attribute(Yamux, "event_closed")),
    fingerprints={"libp2p.network.swarm:Swarm._handle_inbound_connection": "34ac7fb42150850b",
                  "libp2p.network.swarm:Swarm._do_handle_inbound_connection":
                  "a9694c4ad2a8739c"},
))

_SCOPE: contextvars.ContextVar[trio.CancelScope | None] = contextvars.ContextVar(
    "inbound_handler_scope", default=None)


async def _cancel_once_closed(closed: trio.Event, scope: trio.CancelScope) -> None:
    await closed.wait()
    scope.cancel()


def patch_inbound_slots(swarm) -> None:
    handle = swarm._handle_inbound_connection
    if getattr(handle, "_swarm_patched", False):
        return
    upgrade = swarm.upgrade_inbound_raw_conn

    async def upgrade_inbound_raw_conn(raw_conn, maddr):
        muxed = await upgrade(raw_conn, maddr)
        scope = _SCOPE.get()
        closed = getattr(muxed, "event_closed", None)
        if scope is not None and closed is not None:
            swarm.manager.run_task(_cancel_once_closed, closed, scope)
        return muxed

    async def handle_inbound_connection(read_write_closer, maddr) -> None:
        with trio.CancelScope() as scope:
            token = _SCOPE.set(scope)
            try:
                await handle(read_write_closer, maddr)
            finally:
                _SCOPE.reset(token)

    handle_inbound_connection._swarm_patched = True
    swarm.upgrade_inbound_raw_conn = upgrade_inbound_raw_conn
    swarm._handle_inbound_connection = handle_inbound_connection
