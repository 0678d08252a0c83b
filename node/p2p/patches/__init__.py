"""Every run-time replacement of py-libp2p internals, in one place.

py-libp2p 0.8.1 (pinned: `registry.PINNED_LIBP2P`) ends its whole thread on one bad stream,
buffers past the yamux window, drops gossip silently and spends CPU per message where it
need not. Each topic module here states what it replaces, why, the upstream issue or PR,
and registers a `Patch` whose `shape()` says whether its targets still look as written for;
tests/node/p2p/patches has a test per patch that fails when py-libp2p no longer needs it
(the upstream problem is gone) or when it no longer applies (the target changed).

`internals.py` holds the few reads of py-libp2p private state that have no public API
(nothing replaced); the version gate checks their shape too.

Entry points (nothing else in swarm-node replaces py-libp2p code):
- `install()`: the version gate, then every process-wide patch (idempotent);
- `patch_host(host, on_fault)`: per host, before pubsub registers its handlers;
- `patch_pubsub(pubsub, router, ...)`: per pubsub, before its service starts, and
  `patch_running_pubsub(pubsub, admit)` once it runs;
- `patch_connection(muxed_conn, peer, on_violation)`: per connection, as it opens;
- `patch_subscription_channel(...)`: per subscribed topic, after `Pubsub.subscribe`.

Adding one: a module `<topic>.py` with a `register(Patch(...))` per replacement and a
`patch_*`/`install` function, wired into the entry point of its scope below, and a test
module in tests/node/p2p/patches proving the upstream problem without it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import libp2p

from . import (
    accept_gate,
    autodial,
    connected_shield,
    flood_publish,
    handlers,
    inbound_slots,
    internals,
    mesh_backoff,
    noise_io,
    push_msg,
    records,
    rpc_reader,
    rpc_writer,
    send_queues,
    seqno,
    spawn_gate,
    stream_retry,
    subscriptions,
    tcp_tuning,
    validation_cache,
    yamux_buffers,
    yamux_frames,
    yamux_window,
)
from .registry import PATCHES, PINNED_LIBP2P, Patch, PatchError, check_version, problems
from .send_queues import TunedQueues
from .spawn_gate import Admit
from .subscription_channel import patch_subscription_channel

FaultHook = Callable[[str, str, BaseException], None]

__all__ = [
    "PATCHES", "PINNED_LIBP2P", "Admit", "Patch", "PatchError", "QueueLimits", "TunedQueues",
    "check_version", "install", "patch_connection", "patch_host", "patch_pubsub",
    "patch_running_pubsub", "patch_subscription_channel", "problems", "tcp_tuning",
]


def install() -> None:
    """Check the py-libp2p version (PatchError if a patch no longer applies), then apply the
    process-wide patches. Idempotent: a second call changes nothing."""
    check_version(libp2p.__version__)
    if libp2p.__version__ != PINNED_LIBP2P:
        broken = internals.problems()
        if broken:
            raise PatchError(f"py-libp2p {libp2p.__version__} changed private members that "
                             f"swarm-node reads (patches/internals.py): {'; '.join(broken)}. "
                             f"Install libp2p=={PINNED_LIBP2P}.")
    records.install()
    rpc_reader.install()
    rpc_writer.install()
    push_msg.install()
    yamux_window.install()
    yamux_frames.install()
    noise_io.install()
    tcp_tuning.install()


def patch_host(host, on_fault: FaultHook, accept: accept_gate.Admit | None = None) -> None:
    """Stream handlers guarded, the AutoConnector off, inbound slots released on close,
    registered connections kept when their dial is cancelled, and (given `accept`:
    accept_gate.Admit) new inbound connections paced at TCP accept. Before the host listens
    and before pubsub adds its handlers."""
    handlers.patch_stream_handlers(host, on_fault)
    autodial.patch_auto_connector(host)
    inbound_slots.patch_inbound_slots(host.get_network())
    connected_shield.patch_connected_shield(host.get_network())
    if accept is not None:
        accept_gate.patch_accept_gate(host.get_network(), accept)


@dataclass(frozen=True)
class QueueLimits:
    """Per-peer outbound queue: RPC slots, max RPC size, max queued bytes."""

    slots: int
    max_rpc: int
    max_bytes: int


def patch_pubsub(pubsub, router, *, on_fault: FaultHook, metrics, queues: QueueLimits,
                 flood_publish_own: bool) -> TunedQueues:
    """Every per-pubsub patch, before its service starts; returns the peer queues."""
    seqno.patch_seqno(pubsub)
    stream_retry.patch_stream_retry(pubsub)
    tuned = send_queues.patch_send_queues(pubsub, queues.slots, queues.max_rpc,
                                          queues.max_bytes, metrics)
    send_queues.patch_coalesced_sends(pubsub, metrics)
    push_msg.patch_push_msg(pubsub, on_fault)
    subscriptions.patch_keep_subscriptions(pubsub)
    subscriptions.patch_announce_during_setup(pubsub)
    validation_cache.patch_validation_cache(pubsub)
    if flood_publish_own:
        flood_publish.patch_flood_publish(router, pubsub.my_id)
    mesh_backoff.patch_heartbeat_prune_backoff(router)
    mesh_backoff.patch_ihave_to_backed_off(router)
    return tuned


def patch_running_pubsub(pubsub, admit: Admit, queue=None) -> None:
    """Once the pubsub service runs: `admit(forwarder, msg, duplicate)` before any task;
    admitted messages wait in `queue` for a fixed set of validation tasks (spawn_gate)."""
    spawn_gate.patch_spawn(pubsub, admit, queue)


def patch_connection(muxed_conn, peer: str, on_violation: Callable[[str, int], None]) -> bool:
    """The yamux receive window enforced on a new connection (False: not yamux)."""
    return yamux_buffers.patch_stream_buffers(muxed_conn, peer, on_violation)
