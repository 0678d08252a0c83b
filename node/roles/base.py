"""What every role shares: config, identity, p2p host, state, one worker thread, and one
owner of its background tasks.

CPU-heavy work (generation, verification, training, hashing) runs in the role's single
worker thread, so it never blocks the event loop and never races on the model's weights.
Background tasks (the follow watch) belong to `self.background` (node/lifecycle.py): a
failure is logged and counted (`task_failed`), and `close()` cancels and awaits them.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ...verifier.reasons import REASONS as REASON_TEXT
from ...verifier.verdicts import SUMMARY_REASON, parse_summary
from ..errors import NodeError
from ..lifecycle import TaskOwner
from ..p2p import Transport
from ..runtime import BatchLimit
from ..trainer.progress import Stage
from .interfaces import CheckpointFeed, VerifiedCheckpoint

log = logging.getLogger("swarm_node")

FOLLOW_WAIT_PERIODS = 12
"""A followed trainer re-advertises its checkpoints every broadcast.readvertise_s (10 s): with
nothing of it here nor downloading after this many periods (120 s), the operator is told
(once)."""


def freeze_heap() -> None:
    """Move what start-up built (torch, the libraries, a model: ~400k objects that live as
    long as the process) out of the collector's reach: a full collection, triggered more
    often by a flood's allocations, then no longer scans them (it paused every thread for
    0.1-0.7 s each time in a trainer under benchmarks/verifier_flood.py). Called once, at
    the end of a role's start (benchmarks/gc_pause.py measures it)."""
    gc.collect()
    gc.freeze()


def _reasons_text(reasons: dict) -> str:
    return ", ".join(f"{n} {r}: {REASON_TEXT.get(r, r)}" for r, n in reasons.items())


class Role:
    name = "role"

    def __init__(self, cfg, identity, p2p: Transport, state):
        self.cfg = cfg
        self.identity = identity
        self.p2p = p2p
        self.state = state
        self.data_dir: Path = cfg.data_dir
        self.follow_wait_s = FOLLOW_WAIT_PERIODS * cfg.broadcast.readvertise_s
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{self.name}-work")
        self.background = TaskOwner(self.name,
                                    on_failure=lambda name, e: state.count("task_failed"))
        self.preparing: asyncio.Future | None = None  # prepare()'s work, until start() takes it

    def prepare(self) -> None:
        """Begin what `start()` needs no swarm for (a role's model load), while the host
        still dials its bootstrap peers (the runner calls it before the host has joined);
        `start()` finishes it, `close()` drops it. A role without such work: nothing."""

    def begin_load(self, what: str, fn, *args, **kwargs) -> None:
        """`prepare()`'s work, once: `fn` in the worker thread as the start-up stage
        "model_load" (said with an ETA from the last start); `loaded()` waits for it."""
        if self.preparing is None:
            load = Stage(what, "model_load", self.data_dir,
                         self.state.extra.setdefault("starting", {}))
            self.preparing = asyncio.ensure_future(load.around(self.work(fn, *args, **kwargs)))

    async def loaded(self):
        """What `begin_load` loaded (begun now, by `prepare()`, if the runner did not)."""
        self.prepare()
        try:
            return await self.preparing
        finally:
            self.preparing = None

    async def work(self, fn, *args, **kwargs):
        """Run `fn` in the role's worker thread (its name is what Ctrl-C says it waits for)."""
        loop = asyncio.get_running_loop()
        self.current_work = getattr(fn, "__name__", "work")
        try:
            return await loop.run_in_executor(self._pool, lambda: fn(*args, **kwargs))
        finally:
            self.current_work = None

    async def work_oom_safe(self, fn, *args, limit: BatchLimit | None = None, sampler=None,
                            on_oom=None):
        """`work(fn, *args)`, retried with half the batch after an out-of-memory error.

        `limit` is the batch size `fn` reads once per call (a trainer's micro-batch limit),
        or `sampler`'s (its `batch`). `on_oom()` undoes what the failed call left half done
        (run in the worker thread). The limit is halved here, between two calls; at 1 (or
        with no limit to halve) there is nothing smaller to try: one-line NodeError."""
        # oom.py imports torch; a relay (which never calls this) must not load it.
        from .oom import is_oom, release_cached  # noqa: PLC0415

        if limit is None and sampler is not None:
            limit = getattr(sampler, "batch", None)
        while True:
            try:
                return await self.work(fn, *args)
            except Exception as e:
                if not is_oom(e):
                    raise
                release_cached()
                if on_oom is not None:
                    await self.work(on_oom)
                self.state.count("out_of_memory")
                size = limit.value if limit is not None else 1
                knob = limit.name if limit is not None else "the batch size"
                if size <= 1:
                    raise NodeError(f"out of memory in {fn.__name__} even with {knob} = 1: "
                                    "use a smaller model, --set model.dtype=bfloat16, or a "
                                    "larger device (`swarm-node doctor` shows what fits)"
                                    ) from None
                smaller = limit.halve()
                log.warning("out of memory in %s with %s = %d; retrying with %d (hint: set "
                            "--set %s=%d, `swarm-node doctor` shows what fits)",
                            fn.__name__, knob, size, smaller, knob, smaller)

    # Verdicts about this node's rollouts (issue 14: peers must see why they are rejected)

    async def watch_verdicts(self) -> None:
        """Listen on the verdicts topic for verdicts whose subject is this node."""
        await self.p2p.subscribe("verdicts", self._on_own_verdict)

    async def _on_own_verdict(self, env, from_peer: str) -> None:
        v = env.message
        mine = self.state.own_verdicts
        if v.subject != self.identity.peer_id:
            if v.reason == SUMMARY_REASON and env.sender != self.identity.peer_id:
                # every peer's summary: the trainer's accepted total, of which mine is a share
                mine.swarm_summary(env.sender, parse_summary(v.detail)["accepted"])
            return
        if v.reason == SUMMARY_REASON:
            counts = parse_summary(v.detail)
            mine.swarm_summary(env.sender, counts["accepted"])
            if counts["accepted"]:
                mine.add(env.sender, True, "accepted", counts["accepted"], "", v.policy_version)
            for reason, n in counts["reasons"].items():
                mine.add(env.sender, False, reason, n, v.detail, v.policy_version)
            level = logging.INFO if not counts["reasons"] else logging.WARNING
            log.log(level, "trainer %s verified my round %s: %d accepted, %d rejected%s",
                    env.sender[-8:], counts["round"], counts["accepted"],
                    sum(counts["reasons"].values()),
                    f" ({_reasons_text(counts['reasons'])})" if counts["reasons"] else "")
            return
        if v.reason == "banned" and not v.accept:
            mine.add(env.sender, False, "banned", 0, v.detail, v.policy_version)
            log.error("trainer %s banned this node: %s", env.sender[-8:], v.detail)
            return
        if not v.accept:  # the per-rollout verdict beside the summary: its detail says why
            mine.recent.append({"trainer": env.sender, "accept": False, "reason": v.reason,
                                "n": 1, "version": v.policy_version, "detail": v.detail[:200]})
            # INFO: the round's summary beside it is the WARNING (one per round, #29 audit)
            log.info("trainer %s rejected a rollout of mine: %s (%s)", env.sender[-8:],
                        v.reason, v.detail[:200] or REASON_TEXT.get(v.reason, ""))

    async def start(self) -> None:
        """Load what the role needs and subscribe to its topics."""

    def track_downloads(self, feed: CheckpointFeed) -> None:
        """The feed's download in progress in `/status` (taken whenever the state is read),
        each finished download in its record and counters, and the feed's counters at
        `/metrics`."""
        tracker = DownloadTracker(self.state, feed)
        self.state.metrics.before_read(tracker.tick)
        self.state.add_counters("broadcast", feed.counters)

    def watch_swarm(self, feed: CheckpointFeed) -> None:
        """What the feed learned of the swarm's versions and their holders (adverts) in
        /status `extra.swarm`, taken whenever the state is read (dashboard/views.py `swarm`
        joins it with the connections and the per-peer counts)."""
        swarm = getattr(feed, "swarm", None)  # the broadcaster's feed; test fakes have none
        if swarm is None:
            return
        view = self.state.extra.setdefault("swarm", {})

        def refresh() -> None:
            view.clear()
            view.update(swarm())
        self.state.metrics.before_read(refresh)

    def watch_heap(self) -> None:
        """At `/metrics`: the objects the collector tracks (what a full collection scans)
        and those frozen out of its reach (`freeze_heap`), counted when scraped (~10 ms per
        100k objects)."""
        self.state.metrics.gauges(
            "gc_objects", "Objects the garbage collector tracks, and those frozen out of its "
            "reach.", lambda: {"tracked": len(gc.get_objects()),
                               "frozen": gc.get_freeze_count()}, label="kind")

    def count_sampling(self, sampler: Callable[[], object]) -> None:
        """The sampler's seconds by phase at `/metrics` (`swarm_node_sampler_seconds_total`;
        `sampler()`: the one in use, which a role may replace)."""
        self.state.metrics.counters("sampler_seconds", "Seconds spent sampling, by phase.",
                                    lambda: sampler().time_spent(), label="phase")

    def watch_followed(self, feed: CheckpointFeed, trainer: Callable[[], str | None]) -> None:
        """After `follow_wait_s` with no checkpoint of `trainer()` here nor downloading, say
        so once in the log and in /status (`follow`), and again when it appears. The node
        keeps running: the trainer may start later. A node with neither --follow nor
        --bootstrap can learn no trainer: /status says so at once."""
        if trainer() is None and not self.cfg.node.bootstrap:
            self.state.extra["follow"] = {"trainer": None, "seen": False,
                                          "problem": _follow_problem(None, 0.0, False)}

        def heard() -> bool:
            return _heard_from(feed, trainer())

        async def watch():
            # woken by the feed (a download starts or ends, a trainer is chosen); the
            # deadline is when the operator is told
            if await feed.changed.wait_for(heard, timeout=self.follow_wait_s):
                return
            problem = _follow_problem(trainer(), self.follow_wait_s, feed.follow_problem(),
                                      bool(self.cfg.node.bootstrap))
            self.state.extra["follow"] = {"trainer": trainer(), "seen": False,
                                          "problem": problem}
            log.warning("%s", problem)
            await feed.changed.wait_for(heard)
            self.state.extra["follow"] = {"trainer": trainer(), "seen": True}
            log.info("the followed trainer %s appeared: its checkpoint is downloading or here",
                     trainer())
        self.background.spawn(watch(), "follow watch")

    async def run(self, stop: asyncio.Event) -> None:
        await stop.wait()

    async def close(self) -> None:
        await self.background.close()
        if self.preparing is not None:  # prepared, never started (a stop during start-up)
            self.preparing.cancel()  # a call already in the worker thread ends at the shutdown
            failed = (await asyncio.gather(self.preparing, return_exceptions=True))[0]
            if isinstance(failed, Exception):
                log.debug("dropped the prepared start: %s", failed)
            self.preparing = None
        self._pool.shutdown(wait=True, cancel_futures=True)

    # Small persistent counters (survive restarts) -------------------------------------

    def load_json(self, name: str, default):
        try:
            return json.loads((self.data_dir / name).read_text())
        except (OSError, ValueError):
            return default

    def save_json(self, name: str, value) -> None:
        path = self.data_dir / name
        tmp = path.with_name(name + ".tmp")
        with open(tmp, "w") as f:
            json.dump(value, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)


async def wait_any(stop: asyncio.Event, event: asyncio.Event, timeout: float | None) -> bool:
    """Wait for `event` or `stop` (up to `timeout`, None: no limit); True if `event`
    fired."""
    waiters = [asyncio.create_task(stop.wait()), asyncio.create_task(event.wait())]
    try:
        await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waiters:
            w.cancel()
    return event.is_set()


def _heard_from(feed: CheckpointFeed, trainer: str | None) -> bool:
    return trainer is not None and (feed.latest_version(trainer) >= 0 or any(
        d.policy_id == trainer for d in feed.downloads()))


def _follow_problem(trainer: str | None, waited_s: float, why: str | None = None,
                    bootstrap: bool = True) -> str:
    if trainer is None and why:
        return f"no trainer to follow after {waited_s:.0f}s: {why}. Still waiting"
    if trainer is None and not bootstrap:
        return ("no trainer to follow: no --follow and no --bootstrap were given; restart "
                "with the line the trainer printed ('others join with: ...'), which has both")
    if trainer is None:
        return (f"no trainer to follow after {waited_s:.0f}s: no --follow was given and no "
                "bootstrap peer announced one (is it in another swarm? check --swarm); pass "
                "--follow <trainer peer id>. Still waiting")
    return (f"no checkpoint of the followed trainer {trainer} after {waited_s:.0f}s: check "
            "that this is the trainer's peer id (its log says 'joined swarm ... peer id'), "
            "that it is running and that this node's bootstrap peers reach it. Still waiting")


class DownloadTracker:
    """A checkpoint feed's downloads as seen by `/status`: the progress of the one in
    flight (read every tick), and a download record (bytes fetched, seconds) per version
    the feed hands over (an event: a download that starts and ends between two ticks is
    counted too)."""

    def __init__(self, state, feed: CheckpointFeed):
        self.state, self.feed = state, feed
        feed.listen(self.handed_over)

    def tick(self) -> None:
        for d in self.feed.downloads():
            self.state.set_checkpoint_progress(d.version, d.shards_have, d.shards_total,
                                               d.bytes_done, d.bytes_total)

    def handed_over(self, ckpt: VerifiedCheckpoint) -> None:
        if ckpt.downloaded > 0:
            self.state.record_download(ckpt.version, ckpt.policy_id, ckpt.downloaded,
                                       ckpt.seconds)
        self.state.set_checkpoint_progress(ckpt.version, ckpt.shards, ckpt.shards, ckpt.size,
                                           ckpt.size)
