"""Patches: no fault in handling one received message ends pubsub, and our own publishes
skip the verification of the signature we have just made.

- `Pubsub.push_msg` runs as one task per received message under pubsub's service manager;
  in py-libp2p 0.8.1 an exception in it (a topic validator, a malformed field) ends the
  task with an error, and the manager then stops the whole pubsub service. The replacement
  (per pubsub) catches it and reports `on_fault(forwarder, "pubsub.push_msg", error)`.
- `Pubsub.publish` passes our own message through push_msg, which verifies the Ed25519
  signature we made a moment ago (a pass over the whole payload per publish). The module's
  `signature_validator` (process-wide) returns True for a message push_msg marks as our own
  publish (forwarder = us and from = us); every received message is still verified."""

from __future__ import annotations

import contextvars
from collections.abc import Awaitable, Callable

import libp2p.pubsub.pubsub as pubsub_mod
from libp2p.pubsub.pubsub import Pubsub

from .registry import Patch, has_signature, register, replace

FaultHook = Callable[[str, str, BaseException], None]

GUARD = register(Patch(
    name="push_msg_guard",
    scope="pubsub",
    targets=("libp2p.pubsub.pubsub:Pubsub.push_msg",),
    why="an exception while handling one received message stops the pubsub service",
    upstream="py-libp2p #1120 / PR #1117 (fixed the write side only); none filed for "
             "push_msg (searched 2026-09)",
    shape=lambda: has_signature(Pubsub, "push_msg", ("self", "msg_forwarder", "msg"),
                                coroutine=True),
))
SKIP_OWN = register(Patch(
    name="skip_own_signature_check",
    scope="process",
    targets=("libp2p.pubsub.pubsub:signature_validator",),
    why="every publish verifies the signature it has just made (CPU per message)",
    upstream="none filed (searched 2026-09); go-libp2p-pubsub validates only received "
             "messages",
    shape=lambda: (has_signature(pubsub_mod, "signature_validator", ("msg",))
                   + has_signature(Pubsub, "publish", ("self", "topic_id", "data"),
                                   coroutine=True)),
))

_OWN_PUBLISH: contextvars.ContextVar[bool] = contextvars.ContextVar("own_publish",
                                                                    default=False)


def patch_push_msg(pubsub, on_fault: FaultHook) -> None:
    """Guard `pubsub.push_msg`; mark our own publishes for the signature check."""
    inner: Callable[..., Awaitable[None]] = pubsub.push_msg
    if getattr(inner, "_swarm_guarded", False):
        return
    self_id = pubsub.my_id

    async def push_msg(forwarder, msg) -> None:
        token = _OWN_PUBLISH.set(forwarder == self_id and msg.from_id == self_id.to_bytes())
        try:
            await inner(forwarder, msg)
        except Exception as e:  # noqa: BLE001 - one message must not end pubsub: counted
            on_fault(forwarder.to_base58(), "pubsub.push_msg", e)
        finally:
            _OWN_PUBLISH.reset(token)

    push_msg._swarm_guarded = True
    pubsub.push_msg = push_msg


def install() -> None:
    replace(pubsub_mod, "signature_validator",
            _skip_own(pubsub_mod.signature_validator))


def _skip_own(verify):
    if getattr(verify, "_swarm_fast", False):
        return verify

    def signature_validator(msg) -> bool:
        return True if _OWN_PUBLISH.get() else verify(msg)

    signature_validator._swarm_fast = True
    return signature_validator
