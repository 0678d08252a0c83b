"""Patch: a received message passes our admission before pubsub spends a task on it.

py-libp2p 0.8.1's pubsub reader spawns one `push_msg` task per received message
(`manager.run_task(push_msg, forwarder, msg)`) before any limit: its spam limit applies only
when forwarding, after the task, the signature check and the validators ran. A flood then
costs a task, an Ed25519 verification and a decode per message. The replacement of the
manager's `run_task` (per pubsub, once its service runs) asks `admit(forwarder, msg,
duplicate)` first; `duplicate` is True for a copy of a message pubsub already validated
(most copies: every peer receives each message from several mesh peers), which push_msg
would drop at its own seen check anyway: such a copy is never spawned."""

from __future__ import annotations

from collections.abc import Callable

from libp2p.pubsub.pubsub import Pubsub
from libp2p.tools.anyio_service.trio_manager import TrioManager

from .registry import Patch, has_signature, register

Admit = Callable[[object, object, bool], bool]

PATCH = register(Patch(
    name="admit_before_spawn",
    scope="pubsub",
    targets=("libp2p.tools.anyio_service.trio_manager:TrioManager.run_task (pubsub's)",),
    why="every received message gets a task, a signature check and validation before "
        "any rate limit",
    upstream="none filed (searched 2026-09); go-libp2p-pubsub bounds its validation "
             "queue and throttles per peer before validating",
    shape=lambda: (has_signature(TrioManager, "run_task",
                                 ("self", "async_fn", "args", "daemon", "name",
                                  "_internal"))
                   + has_signature(Pubsub, "_is_msg_seen", ("self", "msg"))),
))


def patch_spawn(pubsub, admit: Admit, queue=None, workers: int = 4) -> None:
    """Gate pubsub's push_msg tasks with `admit(forwarder, msg, duplicate) -> bool`.

    Without `queue`, an admitted message gets its task at once (py-libp2p's way). With a
    `queue` (`put(forwarder, msg) -> bool`, `async get() -> (forwarder, msg)`), admitted
    messages wait there instead, and `workers` long-lived tasks run push_msg on what `get`
    hands out: the work in flight is bounded by the queue, and the queue decides the order
    and what to drop. Call once the pubsub service runs; our own publishes pass directly."""
    manager = pubsub.manager
    run_task = manager.run_task
    if getattr(run_task, "_swarm_gate", False):
        return
    self_id = pubsub.my_id

    def gated_run_task(fn, *args, **kwargs):
        if fn == pubsub.push_msg and len(args) == 2 and args[0] != self_id:
            forwarder, msg = args
            if not admit(forwarder, msg, pubsub._is_msg_seen(msg)):
                return None
            if queue is not None:
                queue.put(forwarder, msg)
                return None
        return run_task(fn, *args, **kwargs)

    async def worker() -> None:
        while True:
            forwarder, msg = await queue.get()
            await pubsub.push_msg(forwarder, msg)

    gated_run_task._swarm_gate = True
    manager.run_task = gated_run_task
    if queue is not None:
        for i in range(workers):
            run_task(worker, daemon=True, name=f"swarm-validate-{i}")
