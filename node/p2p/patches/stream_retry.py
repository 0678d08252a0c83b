"""Patch: a failed multistream handshake on a connected peer's pubsub stream is retried.

py-libp2p 0.8.1 registers a newly connected peer with pubsub by opening a stream to it, and
retries while the peer stays connected (`Pubsub._handle_new_peer_with_retry`) — but only for
`SwarmException` and `StreamClosed`. A multistream-select handshake that fails on a
connection still settling (its write failed, or its negotiation timed out: on a loaded
machine, while the yamux upgrade of a parallel dial fails) raises `StreamFailure`, a
`HostException`, which the retry loop treats as "non-retryable" and gives up on. The peer
stays connected, its pings answered, and never hears a gossip message from us again: no
error, no reconnect. Found in CI: an advertiser whose adverts a follower never received
(test_stalling_and_departed_advertisers_do_not_stall_the_download, timed out at 300 s, with
"Failed to open stream ... /meshsub/1.1.0: handshake write failed" in its log). Here a
`HostException` from the stream open is re-raised as a `SwarmException`, so that py-libp2p's
own backoff (0.5 s doubling to 10 s, while connected) retries it."""

from __future__ import annotations

from libp2p.host.exceptions import HostException
from libp2p.network.exceptions import SwarmException
from libp2p.pubsub.pubsub import Pubsub

from .registry import Patch, has_signature, register

PATCH = register(Patch(
    name="retry_pubsub_stream_failure",
    scope="pubsub",
    targets=("libp2p.pubsub.pubsub:Pubsub._handle_new_peer",),
    why="a StreamFailure opening a connected peer's pubsub stream ends the registration "
        "retries: the peer stays connected and never gets gossip",
    upstream="none filed (found here against 0.8.1; upstream main of 2026-08 predates the "
             "retry loop)",
    shape=lambda: (has_signature(Pubsub, "_handle_new_peer", ("self", "peer_id"),
                                 coroutine=True)
                   + has_signature(Pubsub, "_handle_new_peer_with_retry",
                                   ("self", "peer_id", "timeout"), coroutine=True)),
))


class RetryableStreamFailure(SwarmException):
    """A pubsub stream open that failed in the host (multistream handshake): retried."""


def patch_stream_retry(pubsub) -> None:
    """Make `pubsub`'s stream-open failures retryable (per pubsub instance)."""
    handle = pubsub._handle_new_peer

    async def handle_new_peer(peer_id) -> None:
        try:
            await handle(peer_id)
        except HostException as e:
            raise RetryableStreamFailure(f"pubsub stream to {peer_id}: {e}") from e

    pubsub._handle_new_peer = handle_new_peer
