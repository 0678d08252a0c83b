"""Patch: the channel pubsub fills with a subscribed topic's messages is ours: sized by
`p2p.subscription_queue`, and a message dropped on a full channel is counted.

py-libp2p 0.8.1 hands every validated message to the subscription's memory channel with
`send_nowait` (32 slots, SUBSCRIPTION_CHANNEL_SIZE) and only logs a warning when it is full:
the message is lost without a count. `subscribed_topics_send[topic]` is replaced, right
after `Pubsub.subscribe`, by a wrapper around our own channel that counts
`drop_subscription_full`; the node reads the other end."""

from __future__ import annotations

from collections.abc import Callable

import trio
from libp2p.pubsub.pubsub import Pubsub

from .registry import Patch, has_signature, register, sets_attribute

PATCH = register(Patch(
    name="counted_subscription_channel",
    scope="pubsub",
    targets=("libp2p.pubsub.pubsub:Pubsub.subscribed_topics_send[topic]",),
    why="a full subscription channel (32 slots) drops messages with a log line only",
    upstream="none filed (searched 2026-09)",
    shape=lambda: (sets_attribute(Pubsub, "subscribed_topics_send")
                   + has_signature(Pubsub, "notify_subscriptions",
                                   ("self", "publish_message"))),
))


class CountingSendChannel:
    """Stands in for the subscription channel py-libp2p fills with `send_nowait`."""

    def __init__(self, inner: trio.MemorySendChannel, on_drop: Callable[[], None]):
        self.inner = inner
        self.on_drop = on_drop

    def send_nowait(self, msg) -> None:
        try:
            self.inner.send_nowait(msg)
        except trio.WouldBlock:
            self.on_drop()
            raise

    async def aclose(self) -> None:
        await self.inner.aclose()

    def close(self) -> None:
        self.inner.close()


def patch_subscription_channel(pubsub, topic: str, capacity: int,
                               on_drop: Callable[[], None]) -> trio.MemoryReceiveChannel:
    """After `await pubsub.subscribe(topic)`: our channel of `capacity` messages in place of
    py-libp2p's; returns its receiving end."""
    send, recv = trio.open_memory_channel(capacity)
    pubsub.subscribed_topics_send[topic] = CountingSendChannel(send, on_drop)
    return recv
