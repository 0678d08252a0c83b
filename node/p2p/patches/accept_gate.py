"""Patch: a new inbound connection is checked at TCP accept, before any handshake.

py-libp2p 0.8.1 runs multistream, the Noise handshake (X25519, a signature check) and the
yamux upgrade for every accepted TCP connection, then identify, pubsub's hello and our
peer exchange on it; its only check before that is `Swarm.connection_gate`, a static IP
allow/deny list that `dial_peer` consults for our own dials too (so a rate there would
throttle our outbound dials). A many-identity dial flood therefore costs the node a full
upgrade per fresh key (issue #30). The replacement (per swarm) first awaits
`admit(ip, gone)` (our admission.AcceptGate: new inbound connections paced per subnet) with
the accepted stream's remote IP, and closes the stream unread when it says no: an accept, a
wait and a close, no slot of the inbound limiter, no handshake. `gone()` polls the socket
(no wait): True once the dialer closed it while it waited. It wraps whatever `_handle_inbound_connection` the swarm has
(inbound_slots.py's replacement included), so the two compose in either order."""

from __future__ import annotations

import logging
import select
from collections.abc import Awaitable, Callable

from libp2p.io.trio import TrioTCPStream
from libp2p.network.swarm import Swarm

from .registry import Patch, has_signature, register, sets_attribute

log = logging.getLogger(__name__)

PATCH = register(Patch(
    name="inbound_gated_at_accept",
    scope="host",
    targets=("libp2p.network.swarm:Swarm._handle_inbound_connection (per swarm)",),
    why="every accepted TCP connection gets a Noise handshake and an upgrade: no rate of "
        "new inbound connections per address before it (the connection gate is a static "
        "allow/deny list shared with outbound dials)",
    upstream="none filed (go-libp2p has ConnectionGater.InterceptAccept and a per-IP "
             "limit in its resource manager; py-libp2p 0.8.1 has neither)",
    shape=lambda: (has_signature(Swarm, "_handle_inbound_connection",
                                 ("self", "read_write_closer", "maddr"), coroutine=True)
                   + has_signature(TrioTCPStream, "get_remote_address", ("self",))
                   + has_signature(TrioTCPStream, "close", ("self",), coroutine=True)
                   + sets_attribute(TrioTCPStream, "stream")),
))

Admit = Callable[[str | None, Callable[[], bool]], Awaitable[bool]]
"""`await admit(remote ip or None, gone) -> bool`, in the libp2p thread for each accepted
connection before anything is read from it; `gone()`: the dialer closed it."""


def _remote_ip(stream) -> str | None:
    try:
        addr = stream.get_remote_address()
    except Exception:  # noqa: BLE001 - no address: the gate decides on None
        return None
    return str(addr[0]) if addr else None


_CLOSED = select.POLLHUP | select.POLLERR | getattr(select, "POLLRDHUP", 0)


def _gone(stream) -> bool:
    """Did the dialer close `stream` (shut its side, even after sending its multistream
    header) or reset it? A poll of the socket without waiting (POLLRDHUP: Linux); any
    doubt is "not gone"."""
    try:
        fd = stream.stream.socket.fileno()
        poller = select.poll()
        poller.register(fd, _CLOSED)
        return any(events & _CLOSED for _, events in poller.poll(0))
    except Exception:  # noqa: BLE001 - not a socket stream, or already closed: cannot tell
        return False


def patch_accept_gate(swarm, admit: Admit) -> None:
    handle = swarm._handle_inbound_connection
    if getattr(handle, "_accept_gated", False):
        return

    async def handle_inbound_connection(read_write_closer, maddr) -> None:
        if not await admit(_remote_ip(read_write_closer), lambda: _gone(read_write_closer)):
            try:
                await read_write_closer.close()
            except Exception as e:  # noqa: BLE001 - already gone: nothing left to close
                log.debug("closing a connection refused at accept: %s", e)
            return
        await handle(read_write_closer, maddr)

    handle_inbound_connection._accept_gated = True
    handle_inbound_connection._swarm_patched = getattr(handle, "_swarm_patched", False)
    swarm._handle_inbound_connection = handle_inbound_connection
