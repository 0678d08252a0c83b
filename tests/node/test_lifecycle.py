"""Background tasks have one owner; conditions are waited on, not polled (node/lifecycle.py)."""

from __future__ import annotations

import asyncio
import gc
import logging

from swarm_node.node.lifecycle import Changed, TaskOwner, wait_set


async def test_a_failed_task_is_retrieved_logged_and_counted_and_close_cancels_the_rest(caplog):
    loop = asyncio.get_running_loop()
    unretrieved = []
    loop.set_exception_handler(lambda _loop, ctx: unretrieved.append(ctx["message"]))
    failed = []
    owner = TaskOwner("unit", on_failure=lambda name, e: failed.append((name, str(e))))

    async def broken():
        raise RuntimeError("boom")
    forever = owner.spawn(asyncio.Event().wait(), "forever")
    with caplog.at_level(logging.ERROR):
        await asyncio.wait([owner.spawn(broken(), "broken")])
    assert failed == [("broken", "boom")] and owner.failures == {"broken": 1}
    assert "background task broken of unit failed" in caplog.text
    await owner.close(timeout=5)
    assert forever.cancelled() and len(owner) == 0
    gc.collect()  # a task whose exception nobody read would be reported here
    assert unretrieved == []


async def test_changed_wakes_waiters_at_once_and_times_out_with_the_condition():
    changed, state = Changed(), {"n": 0}
    waiter = asyncio.create_task(changed.wait_for(lambda: state["n"] >= 2, timeout=30))
    for _ in range(2):
        await asyncio.sleep(0)  # let the waiter run up to its wait
        state["n"] += 1
        changed.fire()
    assert await asyncio.wait_for(waiter, 5) is True
    assert await changed.wait_for(lambda: state["n"] > 5, timeout=0.05) is False
    assert await changed.wait_for(lambda: True, timeout=0) is True  # checked before waiting


async def test_a_loop_asleep_on_wait_set_ends_when_cancelled_as_it_is_woken():
    """The race of gh-86296: the event is set and the task cancelled in the same step (a
    node closed just after a reachability change woke its dht and relay loops). With
    `asyncio.wait_for(event.wait(), t)` on 3.11 the loop took the wake, ran a round and
    slept again, and its owner's close waited out 10 s."""
    wake = asyncio.Event()
    rounds = []

    async def loop():
        while True:
            rounds.append(len(rounds))
            wake.clear()
            await wait_set(wake, 60)

    task = asyncio.get_running_loop().create_task(loop())
    while not rounds:
        await asyncio.sleep(0)
    await asyncio.sleep(0)  # asleep in wait_set
    wake.set()
    task.cancel()
    await asyncio.wait([task], timeout=5)
    assert task.cancelled() and rounds == [0]
    # and the timeout still returns whether the event came
    assert await wait_set(asyncio.Event(), 0.01) is False
    wake.set()
    assert await wait_set(wake, 0.01) is True
