"""Patch: no exception raised in a stream handler ends the host.

py-libp2p 0.8.1 runs each inbound stream's handler in the connection's nursery without a
guard: any exception in a handler (its own pubsub reader on a protobuf DecodeError, e.g. the
4 bytes `03 ff ff ff` on /meshsub/1.1.0, or one of ours) propagates up through the swarm and
ends `host.run()`, i.e. the whole libp2p thread. Here `host.multiselect.handlers` is replaced
by a dict that wraps every handler as it is stored (py-libp2p's and ours, before or after):
an exception is caught, reported to `on_fault(peer, protocol, error)` (counted and
penalised by the node) and the stream reset.

The same dict closes a race that also ends the host: `Multiselect.negotiate` checks
`protocol in handlers`, awaits its answer to the opener, then reads `handlers[protocol]`; a
handler removed during that await (the DHT's `switch_mode` to client, as a NAT'd node learns
its verdict, removes /ipfs/kad/1.0.0 while peers are opening DHT streams to it) raised
KeyError out of `host.run()` (seen in the 10-node netlab swarm, 2026-12-03: the node
exited 34 s after start). A handler looked up after its removal now resets the stream."""

from __future__ import annotations

from collections.abc import Callable

from libp2p.host.basic_host import BasicHost
from libp2p.protocol_muxer.multiselect import Multiselect

from ..streams import remote_peer, reset_quietly
from .registry import Patch, has_signature, register, sets_attribute

FaultHook = Callable[[str, str, BaseException], None]

PATCH = register(Patch(
    name="stream_handler_guard",
    scope="host",
    targets=("libp2p.protocol_muxer.multiselect:Multiselect.handlers",),
    why="an exception in any stream handler ends host.run() (the libp2p thread)",
    upstream="py-libp2p #417 (open: a failed negotiation takes the listener down); "
             "#1120/PR #1117 fixed the same class of fault for pubsub writes only; "
             "none filed for handler exceptions (searched 2026-09)",
    shape=lambda: (sets_attribute(Multiselect, "handlers")
                   + has_signature(BasicHost, "get_mux", ("self",))),
))

REMOVED = register(Patch(
    name="removed_handler_refused",
    scope="host",
    targets=("libp2p.protocol_muxer.multiselect:Multiselect.handlers",),
    why="a handler removed while a stream negotiates its protocol (the DHT's switch to client "
        "mode removes /ipfs/kad/1.0.0) raises KeyError in Multiselect.negotiate, which ends "
        "host.run(); GuardedHandlers.__missing__ refuses that stream instead",
    upstream="none found (searched 2026-12): py-libp2p PR #1266 added remove_handler (a "
             "plain dict pop) without guarding negotiate's check, await, index",
    shape=lambda: (sets_attribute(Multiselect, "handlers")
                   + has_signature(Multiselect, "remove_handler", ("self", "protocol"))
                   + has_signature(Multiselect, "negotiate",
                                   ("self", "communicator", "negotiate_timeout"),
                                   coroutine=True)),
))

def guarded(protocol_id: str, handler, on_fault: FaultHook):
    """Wrap one libp2p stream handler so that no exception leaves it."""
    if getattr(handler, "_swarm_guarded", False):
        return handler

    async def guard(stream) -> None:
        try:
            await handler(stream)
        except Exception as e:  # noqa: BLE001 - any bytes must not end the host: counted
            try:
                peer = remote_peer(stream)
            except Exception:  # noqa: BLE001 - a stream without a peer: nobody to blame
                peer = "?"
            on_fault(peer, protocol_id, e)
            await reset_quietly(stream)

    guard._swarm_guarded = True
    return guard


class GuardedHandlers(dict):
    """Replaces `host.multiselect.handlers`: each handler is wrapped as it is stored."""

    def __init__(self, initial: dict, on_fault: FaultHook):
        super().__init__()
        self.on_fault = on_fault
        for pid, handler in initial.items():
            self[pid] = handler

    def __setitem__(self, protocol_id, handler) -> None:
        if handler is not None:
            handler = guarded(str(protocol_id), handler, self.on_fault)
        super().__setitem__(protocol_id, handler)

    def __missing__(self, protocol_id):
        """A handler removed while a stream was negotiating it: refuse that stream."""
        return _removed


async def _removed(stream) -> None:
    await reset_quietly(stream)


def patch_stream_handlers(host, on_fault: FaultHook) -> None:
    """Guard every stream handler of `host` (call before pubsub adds its handlers)."""
    mux = host.get_mux()
    if not isinstance(mux.handlers, GuardedHandlers):
        mux.handlers = GuardedHandlers(mux.handlers, on_fault)
