"""The trainer's intake: rollout batches in, verified groups and verdicts out.

`Intake` owns everything between a batch arriving on the `rollouts` topic and its verified
completions reaching the trainer's buffer: the verification queue, the budgets, the
reputation, the per-peer sequential tests (sequential.py), bans, penalties, and the
verdicts the trainer publishes. The trainer role only wires it (node/roles/trainer.py):
gossip handlers call `offer` and `hint`, the training loop calls `drain` and `wait`.

Order of consequences, per batch: bans and budgets first (nothing spent on a banned or
spent sender); then verification (checks.py) in the worker thread; then the sequential
tests on the batch's checked completions; only a batch they pass is handed to the trainer,
and an alarm also drops what the condemned senders still have waiting in the trainer's
buffer. So a batch that sets off an alarm is never trained on.

New identities are free, so budgets bind work, not keys. Senders are split in two tiers
(`established(peer)`: verified history here, reputation.py):

- established senders are served first, round-robin, each with a short queue of its own,
  and each verifies at most `established_tokens` completion tokens per `window_s`;
- probation senders (new or unproven keys) share ONE small bounded queue, fair per
  introducing connection, not per key (`VerificationQueue`: round-robin over subnets, then
  the connections that introduced the keys, then keys, so a newcomer's first batch goes at
  the head of the next round however many keys one connection brings; when it is full, the
  newest batch of the subnet, connection and sender with the most queued is evicted, so a
  flood over a few connections evicts its own), get at most `probation_share` of the
  batches served while established work waits (or the time share, if larger; a credit
  capped at one batch, so a quiet stretch banks nothing for a flood's start), and together
  at most a time share of the worker's time (`TimeShare`: a bucket of verification seconds
  that refills with wall time while probation work waits). The share is priced: it starts
  at `probation_time_share`, rises by `probation_share_step` per accepted probation batch
  up to `probation_time_share_max` (the bucket, `probation_burst_s` deep at the floor,
  deepens with it), and falls back to the floor at the first probation batch found bogus or
  over budget, or evicted as its sender's only one (more fresh senders waiting than slots);
  below it, while probation batches keep failing and none was accepted for
  `probation_hold_s`, each further failure halves it, down to `probation_time_share_min`
  (an accepted batch, or `probation_recover_s` of an empty lane, restores the floor).
  To hold a larger share, an attacker must send batches that verify: sampling with the
  policy, which costs more than the verification costs the trainer. Idle time, when the
  trainer only waits for peers, is lent to them one batch at a time (not while the latest
  probation batch failed: a flood's batches would take it), and counted apart
  (`lent`); so are up to `newcomer_lend` senders' first batches before each of the
  trainer's own sampling rounds while the share is raised (`lend_to_newcomer`). Each
  probation sender starts with a credit of `probation_tokens` verified tokens that does not
  grow with time, only with accepted work (`credit_per_accepted` per accepted,
  model-checked token); a sender past its budget is answered `over_budget` (no penalty, not
  verified). Its batch's groups are checked one at a time until one fails (`probe`), so a
  bogus batch costs one group's forward pass.

A flood of bogus batches from any number of fresh keys therefore costs the trainer at
most `probation_time_share` of its time once it is seen, `probation_time_share_min` once it
lasted `probation_hold_s` (plus what was banked while the share was raised: at most the
raised bucket and one lent batch), established peers are served first throughout, and the flood's own batches mostly
expire in the probation queue unverified. `established` is also what the gossip layer may
use to give peers with verified history priority (a plain callable: peer id -> bool).

A batch is judged stale as of its arrival: `offer` records the policy's latest version then
(`as_of`, checks.py), so the wait in this queue, which is ours, never counts as the sender's
lag (for up to `queue_grace` versions; beyond, `queue_expired`: not verified, no penalty).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from ..node.diskspace import DiskWatch, until_written
from ..protocol.messages import RolloutBatch, TensorData, Verdict
from .checks import RolloutResult, rollout_id
from .reasons import BATCH_REASONS, HONEST_MISTAKES, NOT_JUDGED, PEER_REASONS
from .reputation import Reputation
from .sequential import Alarm, PeerMonitor, SequentialSettings
from .verdicts import SUMMARY_REASON, summary_detail

log = logging.getLogger("swarm_node")

EstablishedPeers = Callable[[str], bool]
"""Whether a peer has verified history at this trainer (the gossip layer's priority hint)."""


@dataclass(frozen=True)
class IntakeLimits:
    per_sender: int = 4  # queued batches per sender
    max_established: int = 256  # queued batches of established senders, in total
    max_probation: int = 16  # queued batches of probation senders, in total
    probation_share: float = 0.2  # of the batches served while established work waits
    probation_time_share: float = 0.1  # of the worker's wall time, all probation senders
    # the share's ceiling and its rise per accepted probation batch (`TimeShare`): it falls
    # back to `probation_time_share` at the first bogus, over-budget or flood-evicted batch
    probation_time_share_max: float = 0.5
    probation_share_step: float = 0.1
    # below the floor, while probation work keeps failing (a flood of fresh keys): each
    # further bogus, over-budget or flood-evicted batch halves the share, down to
    # `probation_time_share_min`, once `probation_hold_s` passed since the last accepted
    # probation batch (a newcomer's next batches keep the floor); no idle time is lent
    # while the latest probation batch failed; an accepted probation batch, or
    # `probation_recover_s` with no probation work waiting, restores the floor (and lending)
    probation_time_share_min: float = 0.02
    probation_hold_s: float = 10.0
    probation_recover_s: float = 5.0
    newcomer_lend: int = 4  # first batches lent time before each of the trainer's own rounds
    # verification seconds they may spend at once: short, so the share is spread over the
    # trainer's loop instead of stalling one step for seconds (a 2-s burst cut an honest
    # peer's acceptance to 18-60% of its baseline in benchmarks/verifier_flood.py)
    probation_burst_s: float = 0.5
    window_s: float = 60.0  # budget window of established senders
    established_tokens: int = 200_000  # completion tokens verified per sender per window
    probation_tokens: int = 8_192  # a new sender's credit (does not grow with time)
    credit_per_accepted: float = 2.0  # credit per accepted, model-checked token
    max_budget_peers: int = 10_000  # senders with a budget record (LRU)
    drain_max_s: float = 30.0  # longest verification stretch before training gets its turn
    bogus_report: int = 1  # connection-penalty offences per bogus probation batch
    ban_notice_s: float = 60.0  # a banned peer is told at most this often


class Budget:
    """Completion tokens verified per sender: a rate for established senders (per window),
    a credit for probation senders that only accepted work refills. LRU-bounded."""

    def __init__(self, limits: IntakeLimits, clock: Callable[[], float] = time.monotonic):
        self.limits = limits
        self.clock = clock
        self._used: OrderedDict[str, tuple[float, int]] = OrderedDict()  # start, tokens
        self._credit: OrderedDict[str, float] = OrderedDict()

    def _touch(self, table: OrderedDict, sender: str, value) -> None:
        table[sender] = value
        table.move_to_end(sender)
        while len(table) > self.limits.max_budget_peers:
            table.popitem(last=False)

    def charge(self, sender: str, tokens: int, established: bool) -> bool:
        """Spend `tokens` of `sender`'s budget; False (nothing spent) when it is spent."""
        if not established:
            credit = self._credit.get(sender, float(self.limits.probation_tokens))
            if credit <= 0:
                return False
            self._touch(self._credit, sender, credit - tokens)  # one batch may overdraw
            return True
        now = self.clock()
        start, used = self._used.get(sender, (now, 0))
        if now - start >= self.limits.window_s:
            start, used = now, 0
        if used + tokens > self.limits.established_tokens and used > 0:
            return False
        self._touch(self._used, sender, (start, used + tokens))
        return True

    def refund(self, sender: str, tokens: int, established: bool) -> None:
        """Give back a charge for work that was not the sender's doing (a re-delivery)."""
        if not established and sender in self._credit:
            self._touch(self._credit, sender, self._credit[sender] + tokens)
        elif established and sender in self._used:
            start, used = self._used[sender]
            self._touch(self._used, sender, (start, max(0, used - tokens)))

    def earn(self, sender: str, tokens: int) -> None:
        """Accepted, model-checked work raises a probation sender's credit."""
        if sender in self._credit:
            self._touch(self._credit, sender,
                        self._credit[sender] + tokens * self.limits.credit_per_accepted)

    def credit(self, sender: str) -> float:
        return self._credit.get(sender, float(self.limits.probation_tokens))


class TimeShare:
    """A bucket of verification seconds for probation senders: refills at `share` seconds
    per second of wall time up to `burst_s` (only while `waiting()`, and for
    `quiet_grace_s` after it stopped); work spends it (a batch in flight may overdraw
    it: the debt is repaid in full before the next, so a long batch costs its own time,
    whatever `burst_s`).

    Adaptive between `share` (the floor) and `top`: each accepted probation batch raises it
    by `step` (`rise`), the first bogus, over-budget or flood-evicted one drops it back to
    the floor (`fall`). The burst scales with it (`burst_s` at the floor), so a raised share
    may verify several newcomers' batches between two of the trainer's steps, and a fallen
    one is back to short turns at once.

    Below the floor: each further failing batch at the floor halves the share, down to
    `low`, once `hold_s` passed since the last accepted one (a newcomer's next batches,
    before it is established, keep the floor), so a sustained flood of failing fresh keys
    gets `low` of the time (the `verifier-flood` benchmark: 0.3-0.5 s of the trainer's
    verification a 15-s window, against 0.4-0.9 s at the floor with idle time lent). An
    accepted probation batch lifts it back to the
    floor and a step above (`rise`), and so does `recover_s` with no probation work
    waiting (the flood is over): a newcomer is never held below the floor longer than the
    flood that put it there."""

    def __init__(self, share: float, burst_s: float,
                 clock: Callable[[], float] = time.monotonic, *, top: float | None = None,
                 step: float = 0.0, waiting: Callable[[], bool] | None = None,
                 quiet_grace_s: float = 0.2, low: float | None = None,
                 hold_s: float = 10.0, recover_s: float = 5.0):
        self.floor, self.top, self.step = share, max(share, top or share), step
        self.low = share if low is None else min(share, max(low, 1e-3))
        self.hold_s, self.recover_s = hold_s, recover_s
        self._accepted_at = float("-inf")  # the last accepted probation batch
        self._failing = False
        self.share, self.clock, self._burst_s = share, clock, burst_s
        # whether probation work waits (None: always): the bucket refills then and for
        # `quiet_grace_s` after the lane emptied (a turn of the trainer's loop, which may
        # empty it between two arrivals of a steady stream), so share that no work asked
        # for is not banked for a flood's start (a full 0.5-s bucket let one drain verify
        # ~20-30 bogus batches in a row while the trainer's step waited, 0.4-0.7 s, in
        # benchmarks/verifier_flood.py: refilled through the quiet 30 s, and with a 1-s
        # grace through the flood's tail, a trickle that idle time served); the caller
        # settles it (`level`) before work arrives
        self.waiting, self.quiet_grace_s = waiting, quiet_grace_s
        self._quiet_since: float | None = None
        self._level, self._at = burst_s, clock()

    @property
    def burst_s(self) -> float:
        return self._burst_s * (self.share / self.floor if self.floor > 0 else 1.0)

    @property
    def raised(self) -> bool:
        """Above the floor: recent probation work was verified and accepted."""
        return self.share > self.floor

    @property
    def failing(self) -> bool:
        """The latest probation batch failed (`fall`; until one is accepted or the lane
        stays empty for `recover_s`): no idle time is lent then."""
        return self._failing

    def level(self) -> float:
        now = end = self.clock()
        if self.waiting is None or self.waiting():
            self._quiet_since = None
        else:
            if self._quiet_since is None:
                self._quiet_since = self._at
            end = max(self._at, min(now, self._quiet_since + self.quiet_grace_s))
            if self._failing and now - self._quiet_since >= self.recover_s:
                # the lane stayed empty: the flood is over
                self.share, self._failing = max(self.share, self.floor), False
        self._level = min(self.burst_s, self._level + (end - self._at) * self.share)
        self._at = now
        return self._level

    def ready(self) -> bool:
        return self.level() > 0

    def ready_in(self) -> float:
        """Seconds until `ready()` (0 when ready now)."""
        level = self.level()
        return 0.0 if level > 0 else (-level) / self.share + 1e-3 if self.share > 0 else 1e9

    def spend(self, seconds: float) -> None:
        self._level = self.level() - seconds

    def rise(self) -> None:
        """An accepted probation batch: the share rises a step (up to `top`), from the
        floor at least."""
        self.level()  # the refill so far at the old rate
        self.share = min(self.top, max(self.share, self.floor) + self.step)
        self._accepted_at, self._failing = self.clock(), False

    def fall(self) -> None:
        """A bogus, over-budget or flood-evicted probation batch: back to the floor, or
        from it (or below) half the way down, to `low` at least, once `hold_s` passed since
        the last accepted one."""
        self.level()
        self._failing = True
        if self.share > self.floor:
            self.share = self.floor
        elif self.clock() - self._accepted_at >= self.hold_s:
            self.share = max(self.low, self.share / 2)
        self._level = min(self._level, self.burst_s)


Via = tuple[str, str]
"""(connection, subnet) that introduced a sender (`Intake.offer`): the sender itself once it has
(had) a libp2p connection of its own to this node, else the peer that first brought its key
(`Admission.introducer`), and that connection's /24 (IPv4) or /48 (IPv6); "?" if unknown."""

_SUBNET, _CONN, _KEY = range(3)  # the probation lane's levels of fairness


@dataclass
class _Waiting:
    arrival: int
    path: tuple[str, str, str]  # (subnet, connection, sender)
    item: object


class VerificationQueue:
    """Fair, bounded queue of (sender, item). Not thread-safe: one event loop owns it.

    Established senders: round-robin, each with its own short queue (`per_sender`).

    Probation senders share one queue (at most `per_sender` each, `max_probation` in all),
    fair per INTRODUCING CONNECTION, not per key: keys are free, connections are not
    (new inbound ones per subnet and second, few new keys per connection: admission.py). A
    batch's path is (subnet, connection, sender) (`Via`); at each level in turn the group
    served next is the one with the fewest turns, then the fewest batches ever served, then
    the oldest batch. A group that had nothing waiting starts at the fewest turns among
    its waiting siblings (it cannot bank turns while quiet), so the lane is a round-robin
    over subnets, then their connections, then their keys, and a newcomer's first batch
    goes at the head of the next round. When the queue is full, the victim comes from the
    group with the most queued at each level (ties: the most served, then at random), and
    is its newest batch: a group keeps its place and its oldest batch, the next it would
    be served. So a flood of fresh keys over a few connections evicts its own batches, not
    a newcomer's on another connection. Evicting a sender's only batch (a fresh-key
    flood's shape) is counted in `flood_evictions`.

    Without a `via`, a sender is its own connection in subnet "?" (fair per key)."""

    def __init__(self, is_established: Callable[[str], bool],
                 limits: IntakeLimits | None = None, rng: random.Random | None = None):
        self.is_established = is_established
        self.limits = limits or IntakeLimits()
        self.rng = rng or random.Random()
        self._est: OrderedDict[str, deque] = OrderedDict()
        self._est_count = 0
        self._prob: list[_Waiting] = []  # at most max_probation (+1 while putting)
        # (level, name) -> batches ever served / turns taken (LRU, 3 x max_budget_peers)
        self._prob_served: OrderedDict[tuple[int, str], int] = OrderedDict()
        self._turns: OrderedDict[tuple[int, str], int] = OrderedDict()
        self._arrivals = itertools.count()
        # the probation lane's credit for picks while established work waits (`get`)
        self._prob_credit = 0.0
        self.flood_evictions = 0
        self.dropped: dict[str, int] = {}

    def __len__(self) -> int:
        return self._est_count + len(self._prob)

    @property
    def established_waiting(self) -> int:
        return self._est_count

    @property
    def probation_waiting(self) -> int:
        return len(self._prob)

    def served(self, sender: str) -> int:
        """Probation batches of `sender` served so far (LRU-bounded memory)."""
        return self._prob_served.get((_KEY, sender), 0)

    def _drop(self, why: str) -> None:
        self.dropped[why] = self.dropped.get(why, 0) + 1

    def _tally(self, table: OrderedDict, key: tuple[int, str], value: int) -> None:
        table[key] = value
        table.move_to_end(key)
        while len(table) > 3 * self.limits.max_budget_peers:
            table.popitem(last=False)

    def put(self, sender: str, item, via: Via | None = None) -> bool:
        """Queue `item`; False if it was dropped (counted in `dropped`). `via`: the
        (connection, subnet) that introduced `sender` (probation senders only)."""
        lim = self.limits
        if self.is_established(sender):
            q = self._est.setdefault(sender, deque())
            if len(q) >= lim.per_sender or self._est_count >= lim.max_established:
                self._drop("established_full")
                if not q:
                    del self._est[sender]
                return False
            q.append(item)
            self._est_count += 1
            return True
        if sum(w.path[_KEY] == sender for w in self._prob) >= lim.per_sender:
            self._drop("probation_sender_full")
            return False
        conn, subnet = via or (sender, "?")
        new = _Waiting(next(self._arrivals), (subnet, conn, sender), item)
        self._start_turns(new.path)
        self._prob.append(new)
        if len(self._prob) <= lim.max_probation:
            return True
        victim, only = self._victim()
        self._prob.remove(victim)
        self._drop("probation_evicted")
        if only:
            self.flood_evictions += 1
        return victim is not new

    def _start_turns(self, path: tuple[str, str, str]) -> None:
        """A group with nothing waiting starts at the fewest turns of its waiting siblings."""
        for level in (_SUBNET, _CONN, _KEY):
            siblings = [w for w in self._prob if w.path[:level] == path[:level]]
            if not siblings or any(w.path[level] == path[level] for w in siblings):
                continue
            floor = min(self._turns.get((level, w.path[level]), 0) for w in siblings)
            key = (level, path[level])
            self._tally(self._turns, key, max(self._turns.get(key, 0), floor))

    def _victim(self) -> tuple[_Waiting, bool]:
        """The batch a full probation queue evicts, and whether it was its sender's only."""
        cands = self._prob
        for level in (_SUBNET, _CONN, _KEY):
            counts = Counter(w.path[level] for w in cands)
            weight = {g: (n, self._prob_served.get((level, g), 0)) for g, n in counts.items()}
            top = max(weight.values())
            group = self.rng.choice(sorted(g for g, w in weight.items() if w == top))
            cands = [w for w in cands if w.path[level] == group]
        return max(cands, key=lambda w: w.arrival), len(cands) == 1

    def _head(self) -> _Waiting | None:
        """The probation batch served next (see the class docstring)."""
        cands = self._prob
        for level in (_SUBNET, _CONN, _KEY):
            if not cands:
                return None
            oldest: dict[str, int] = {}
            for w in cands:
                oldest[w.path[level]] = min(oldest.get(w.path[level], w.arrival), w.arrival)
            group = min(oldest, key=lambda g: (self._turns.get((level, g), 0),
                                               self._prob_served.get((level, g), 0),
                                               oldest[g]))
            cands = [w for w in cands if w.path[level] == group]
        return min(cands, key=lambda w: w.arrival)

    def get(self, probation_ok: bool = True,
            probation_share: float | None = None) -> tuple[str, object] | None:
        """The next (sender, item), or None when nothing may be served now (probation
        batches only when `probation_ok`; `probation_share`: of the batches served while
        established work waits, `limits.probation_share` by default)."""
        share = self.limits.probation_share if probation_share is None else probation_share
        take_prob = probation_ok and bool(self._prob)
        if take_prob and self._est_count:
            # both lanes wait: a credit of `share` a pick, capped at one batch, so probation
            # takes every 1/share-th such pick and established work the rest, the first
            # included; what was served while the other lane was empty banks nothing (a
            # lifetime ratio let a flood's start catch up on the whole quiet past: dozens
            # of bogus batches in a row ahead of an established peer's, 0.9 s, in
            # benchmarks/verifier_flood.py)
            self._prob_credit = min(1.0, self._prob_credit + share)
            take_prob = self._prob_credit >= 1.0 - 1e-9
            if take_prob:
                self._prob_credit -= 1.0
        if take_prob:
            return self.get_probation()
        if not self._est_count:
            return None
        sender, q = next(iter(self._est.items()))
        item = q.popleft()
        self._est_count -= 1
        del self._est[sender]
        if q:
            self._est[sender] = q  # back of the round
        return sender, item

    def next_probation(self) -> str | None:
        """The probation sender served next (see the class docstring)."""
        head = self._head()
        return None if head is None else head.path[_KEY]

    def get_probation(self) -> tuple[str, object] | None:
        """The next probation (sender, item) (`next_probation`), whatever the shares."""
        head = self._head()
        if head is None:
            return None
        self._prob.remove(head)
        for level in (_SUBNET, _CONN, _KEY):
            key = (level, head.path[level])
            self._tally(self._prob_served, key, self._prob_served.get(key, 0) + 1)
            self._tally(self._turns, key, self._turns.get(key, 0) + 1)
        return head.path[_KEY], head.item


class Verifier(Protocol):
    def verify(self, batch: RolloutBatch, sender: str, spot_check=None,
               probe: bool = False, as_of: int | None = None) -> list[RolloutResult]:
        """One result per completion, in order (worker thread). `as_of`: `latest_version()`
        when the batch arrived (staleness is judged against it)."""

    def latest_version(self) -> int:
        """The newest version of the verifier's policy known here."""


class GroupSink(Protocol):
    """Where verified work goes (the trainer; its calls run in the worker thread)."""

    def add_external(self, batch: RolloutBatch, sender: str = "",
                     as_of: int | None = None) -> int:
        """Store `sender`'s verified batch; `as_of`: the policy's latest version when it
        arrived (its wait in this queue is not staleness: node/trainer/trainer.py)."""

    def drop_sender(self, sender: str) -> int:
        """Forget `sender`'s verified groups that no step has used yet; returns how many."""


@dataclass
class _Ports:
    """What the intake does to the world, as callables the host provides."""

    publish: Callable[[Verdict], Awaitable[None]]  # a verdict onto the `verdicts` topic
    report: Callable[[str, int, str], object] | None  # (gossip origin, offences, why)
    work: Callable[..., Awaitable]  # run fn(*args) in the worker thread that owns the model


class Intake:
    """Batches in (`offer`), verified groups to `sink`, verdicts out. One event loop owns
    it; verification and the sink run in the worker thread through `work`."""

    def __init__(self, own_id: str, reputation: Reputation,
                 verifier_for: Callable[[str], Verifier | None], sink: GroupSink, state,
                 *, publish: Callable[[Verdict], Awaitable[None]],
                 work: Callable[..., Awaitable], disk: DiskWatch,
                 monitor: PeerMonitor | None = None, limits: IntakeLimits | None = None,
                 report: Callable[[str, int, str], object] | None = None,
                 trusted: Callable[[str], bool] = lambda peer: False,
                 introducer: Callable[[str], Via] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.own_id = own_id
        self.reputation = reputation
        self.verifier_for = verifier_for  # policy id -> its verifier; None: not verifiable here
        self.sink = sink
        self.state = state
        self.ports = _Ports(publish, report, work)
        self.disk = disk
        self.monitor = monitor or PeerMonitor()
        self.limits = limits or IntakeLimits()
        self.trusted = trusted  # besides established peers: whose verdicts are hints (trainers)
        # sender -> (connection, subnet) that introduced it: the probation lane's fairness
        self.introducer = introducer or (lambda sender: (sender, "?"))
        self.clock = clock
        self.queue = VerificationQueue(self.established, self.limits)
        self.budget = Budget(self.limits, clock)
        self.share = TimeShare(self.limits.probation_time_share, self.limits.probation_burst_s,
                               clock, top=self.limits.probation_time_share_max,
                               step=self.limits.probation_share_step,
                               waiting=lambda: self.queue.probation_waiting > 0,
                               low=self.limits.probation_time_share_min,
                               hold_s=self.limits.probation_hold_s,
                               recover_s=self.limits.probation_recover_s)
        self.arrived = asyncio.Event()
        self.verified_batches = 0  # batches with accepted rollouts (the caller resets it)
        self._told_banned: OrderedDict[str, float] = OrderedDict()
        # what /status shows (extra.intake; the same dict, updated in place)
        # verification time by tier (probation_lent: idle time lent beyond the share)
        self.seconds = {"established": 0.0, "probation": 0.0, "probation_lent": 0.0}
        self.batches: Counter = Counter()  # verified, by tier; alarms; already accepted
        self.verdicts: Counter = Counter()  # others' verdicts heard: used as hints, ignored
        self.view: dict = {}
        self._update_view()

    def _update_view(self) -> None:
        self.view.update(
            queued=len(self.queue), established_waiting=self.queue.established_waiting,
            dropped=dict(self.queue.dropped),
            verify_seconds={k: round(v, 2) for k, v in self.seconds.items()},
            batches=dict(self.batches), verdicts=dict(self.verdicts),
            probation_share_s=round(self.share.level(), 2),
            probation_time_share=round(self.share.share, 3),
            pooled_alarms=self.monitor.pooled_alarms)

    @classmethod
    def for_trainer(cls, cfg, own_id: str, verifier_for: Callable[[str], Verifier | None],
                    sink: GroupSink, state, *, reputation: Reputation | None = None,
                    **ports) -> Intake:
        """A trainer's intake from its node config: the reputation persisted in
        `<data_dir>/reputation.json` (`[verifier]` settings) and the sequential tests'
        parameters for `model.dtype`. `ports`: publish, work, disk, report, trusted,
        introducer, limits."""
        if reputation is None:
            reputation = Reputation.from_config(cfg.verifier, cfg.data_dir / "reputation.json")
        monitor = PeerMonitor(SequentialSettings.for_dtype(cfg.model.dtype))
        return cls(own_id, reputation, verifier_for, sink, state, monitor=monitor, **ports)

    # what others may ask ------------------------------------------------------------------

    def counters(self) -> dict[str, float]:
        """Monotonic counters for /metrics (`swarm_node_intake_total{name=...}`): batches
        dropped unverified by reason, verified by tier, already accepted, alarms by test;
        verification seconds by tier."""
        out: dict[str, float] = {f"dropped_{k}": v for k, v in self.queue.dropped.items()}
        out.update({f"batches_{k}": v for k, v in self.batches.items()})
        out.update({f"verify_seconds_{k}": round(v, 3) for k, v in self.seconds.items()})
        return out

    def established(self, peer: str) -> bool:
        """Verified history here (reputation.py): served first, budgets as a rate."""
        return self.reputation.established(peer)

    def is_banned(self, peer: str) -> bool:
        return self.reputation.is_banned(peer)

    def banned(self) -> list[str]:
        """Peers banned now (bans expire)."""
        return self.reputation.banned()

    def close(self) -> None:
        """Persist what must survive a restart (the reputation)."""
        self.reputation.save()

    # incoming (event loop) ----------------------------------------------------------------

    async def offer(self, env, origin: str) -> None:
        """A `RolloutBatch` envelope from the gossip layer; `origin` is its gossip origin (the
        envelope's signer), whom the transport charges for a bogus probation batch. A
        probation sender's batch waits in its introducing connection's and subnet's turn
        (`introducer`: the transport's `introducer`, admission.py)."""
        sender = env.sender
        if self.reputation.is_banned(sender):
            self.state.reject(sender, "banned", len(env.message.completions))
            return
        # the version a batch is judged against: the one when it arrived (the wait in this
        # queue is ours, not the sender's lag; checks.py `as_of`)
        verifier = self.verifier_for(env.message.policy_id)
        as_of = verifier.latest_version() if verifier is not None else None
        flood = self.queue.flood_evictions
        self.share.level()  # settled before the lane changes: no refill while it was empty
        via = None if self.established(sender) else self.introducer(sender)
        if not self.queue.put(sender, (env.message, origin, as_of), via):
            self.state.count("rollout_queue_full")
            log.debug("verification queue: dropped a batch from %s (not verified, not "
                      "accepted)", sender[-8:])
        if self.queue.flood_evictions > flood:  # more fresh senders than slots: a flood
            self.share.fall()
        self.arrived.set()
        self._update_view()

    async def hint(self, env, origin: str) -> None:
        """A `Verdict` from another peer: a hint only, from a peer with verified history
        here or a trusted one (a followed trainer); see Reputation.hint."""
        trusted = self.established(env.sender) or self.trusted(env.sender)
        used = self.reputation.hint(env.message, env.sender, trusted=trusted)
        self.verdicts["used" if used else "ignored"] += 1
        self._update_view()

    # serving ------------------------------------------------------------------------------

    def _lend(self, idle: bool) -> bool:
        """Whether idle time may go to probation work beyond the share: not while the
        latest probation batch failed (`TimeShare.failing`: a flood of fresh keys)."""
        return idle and not self.share.failing

    def _next(self, idle: bool) -> tuple[str, object] | None:
        return self.queue.get(probation_ok=self._lend(idle) or self.share.ready(),
                              probation_share=max(self.limits.probation_share,
                                                  self.share.share))

    def newcomer_waiting(self) -> bool:
        """A first batch of a probation sender waits while the share is raised (the latest
        probation work was accepted): what `lend_to_newcomer` would verify."""
        nxt = self.queue.next_probation()
        return self.share.raised and nxt is not None and self.queue.served(nxt) == 0

    async def lend_to_newcomer(self, stop: asyncio.Event | None = None) -> int:
        """Verify waiting first batches of probation senders beyond the share (counted as
        lent), at most `newcomer_lend`, each only while the share is raised
        (`newcomer_waiting`): the trainer defers its own sampling for them. Priced: the
        share rises only with accepted probation batches and falls to its floor at the
        first bogus one, so a flood gets at most one lent batch per accepted one. Returns
        the batches verified."""
        done = 0
        while (done < self.limits.newcomer_lend and self.newcomer_waiting()
               and not (stop is not None and stop.is_set())):
            sender, (batch, origin, as_of) = self.queue.get_probation()
            await self._one(sender, batch, origin, True, as_of)
            self._update_view()
            done += 1
        return done

    def servable(self, idle: bool = False) -> bool:
        """Whether `drain` would verify something now."""
        return bool(self.queue.established_waiting) or (
            len(self.queue) > 0 and (self._lend(idle) or self.share.ready()))

    async def wait(self, stop: asyncio.Event, timeout: float, idle: bool = False) -> None:
        """Until something is servable (or a batch arrives), `stop` is set, or `timeout`."""
        if self.servable(idle):
            return
        self.arrived.clear()
        if len(self.queue):  # probation work waiting for its time share
            timeout = min(timeout, self.share.ready_in())
        waiters = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(self.arrived.wait())]
        try:
            await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waiters:
                w.cancel()

    async def drain(self, stop: asyncio.Event | None = None, idle: bool = False) -> int:
        """Verify queued batches, established senders first, for at most `drain_max_s`
        (a flood must not stop training) or until `stop`. `idle`: the trainer has nothing
        else to do until a batch arrives, so ONE batch is verified, and a probation sender's
        may use time beyond their share (counted as lent): the caller looks again after
        each. Returns the batches verified."""
        deadline = self.clock() + self.limits.drain_max_s
        done = 0
        while self.clock() < deadline and not (stop is not None and stop.is_set()):
            lent = self._lend(idle) and not self.share.ready()
            nxt = self._next(idle)
            if nxt is None:
                break
            sender, (batch, origin, as_of) = nxt
            await self._one(sender, batch, origin, lent, as_of)
            done += 1
            self._update_view()
            if idle:
                break
        return done

    async def _one(self, sender: str, batch: RolloutBatch, origin: str,
                   lent: bool = False, as_of: int | None = None) -> None:
        n = len(batch.completions)
        if self.reputation.is_banned(sender):
            self.state.reject(sender, "banned", n)
            return
        verifier = self.verifier_for(batch.policy_id)
        if verifier is None:  # not this trainer's policy and not one it follows
            self.state.reject(sender, "unknown_policy", n)
            return
        established = self.established(sender)
        tokens = sum(c.completion_ids.shape[0] for c in batch.completions)
        if not self.budget.charge(sender, tokens, established):
            results = _all(batch, "over_budget", "verification budget of this sender is spent")
            if not established:
                self.share.fall()
        else:
            t0 = self.clock()
            results = await until_written(  # disk full: pause, keep the batch
                self.disk, self.ports.work, verifier.verify, batch, sender,
                lambda ids: self.reputation.should_verify_group(sender, ids), not established,
                as_of)
            spent = self.clock() - t0
            tier = "established" if established else "probation_lent" if lent \
                else "probation"
            if tier == "probation":
                self.share.spend(spent)
            self.seconds[tier] = self.seconds.get(tier, 0.0) + spent
            self.batches[tier] += 1
            self.state.observe("verify_batch_seconds", spent)
        if all(r.reason == "queue_expired" for r in results):  # not verified: our wait
            self.budget.refund(sender, tokens, established)
            self.batches["queue_expired"] += 1
        if all(r.reason in NOT_JUDGED for r in results):  # this very batch, accepted before
            self.budget.refund(sender, tokens, established)
            self.batches["already_accepted"] += 1
            self.state.count("batches_already_accepted")
            log.debug("round %d from %s again (accepted before): ignored", batch.round,
                      sender[-8:])
            return
        if not established and self.reputation.reprobation(sender):
            # the head start of a condemned peer's tests, from its persisted record: a
            # restart (or the tests' LRU) must not give a caught steerer a clean slate
            self.monitor.condemned(sender)
        alarm = self.monitor.observe_batch(
            sender, [r.stats for r in results if r.reason == "ok"], probation=not established)
        if alarm is not None and sender in alarm.peers:
            results = _condemned(results, alarm)
        accepted = [_verified_completion(batch.completions[r.index], r)
                    for r in results if r.accept]
        if not established:  # the adaptive share: priced by verified work
            if any(not r.accept and r.reason not in HONEST_MISTAKES for r in results):
                self.share.fall()
            elif accepted:
                self.share.rise()
        if accepted:
            await until_written(self.disk, self.ports.work, self.sink.add_external,
                                batch.model_copy(update={"completions": accepted}), sender,
                                as_of)
            self.budget.earn(sender, sum(batch.completions[r.index].completion_ids.shape[0]
                                         for r in results if r.reason == "ok"))
        if alarm is not None:
            await self._alarmed(alarm, sender, batch, results[0].rollout_id)
        await self._judge(batch, sender, origin, results, established)

    # consequences -------------------------------------------------------------------------

    async def _alarmed(self, alarm: Alarm, sender: str, batch: RolloutBatch,
                       rid: bytes) -> None:
        """Every peer the alarm condemns: banned (no history) or penalised (established),
        its waiting groups dropped from the trainer's buffer, and told."""
        self.batches[f"alarm_{alarm.test}"] += 1
        for peer in alarm.peers:
            self.reputation.record_alarm(peer, alarm.reason)
            self.monitor.condemned(peer)  # its tests restart with a head start
            dropped = await self.ports.work(self.sink.drop_sender, peer)
            self.state.count(f"sequential_{alarm.reason}")
            log.warning("peer %s failed the %s test (%s%s); %d of its waiting groups dropped",
                        peer[-8:], alarm.reason, alarm.test,
                        f", with {len(alarm.peers) - 1} others" if len(alarm.peers) > 1
                        else "", dropped)
            await self._publish(Verdict(rollout_id=rid if peer == sender else bytes(32),
                                        subject=peer, accept=False,
                                        reason=alarm.reason, policy_version=batch.policy_version,
                                        detail=f"sequential test ({alarm.test})"))
            if peer != sender and self.reputation.is_banned(peer):
                await self._ban_notice(peer, bytes(32), f"{alarm.reason} ({alarm.test})")

    async def _judge(self, batch, sender, origin, results, established) -> None:
        """Reputation, metrics, logs, verdicts and connection penalties of one batch."""
        first_reject = None
        batch_level = (not any(r.accept for r in results)
                       and len({r.reason for r in results}) == 1
                       and results[0].reason in BATCH_REASONS)
        if batch_level:  # one fault of the batch, not one per completion
            self.reputation.record(sender, False, results[0].reason)
        for r in results:
            # trust only from checks; an alarm was recorded once (record_alarm)
            if not batch_level and r.reason not in ("unchecked", *PEER_REASONS):
                self.reputation.record(sender, r.accept, r.reason)
            if r.accept:
                self.state.accept(sender)
            else:
                self.state.reject(sender, r.reason)
                if first_reject is None or first_reject.reason in ("group_member_rejected",
                                                                   "batch_member_rejected"):
                    first_reject = r  # the verdict names the cause, not the collateral
        n_ok = sum(r.accept for r in results)
        self.verified_batches += n_ok > 0
        log.info("verified round %d from %s: %d accepted, %d rejected%s", batch.round,
                 sender[-8:], n_ok, len(results) - n_ok,
                 f" (first: {first_reject.reason})" if first_reject else "")
        cheat = any(not r.accept and r.reason not in HONEST_MISTAKES for r in results)
        if cheat and not established and self.ports.report is not None and origin:
            # the signer pays; the transport throttles whoever keeps introducing such keys
            self.ports.report(origin, self.limits.bogus_report, "bogus_batch")
        banned = self.reputation.is_banned(sender)
        if banned and sender not in self.state.banned:
            self.state.banned = self.reputation.banned()
            log.warning("banned peer %s (reputation %.1f)", sender,
                        self.reputation.score(sender))
        if first_reject is not None and first_reject.reason not in PEER_REASONS:
            await self._publish(first_reject.verdict(sender, batch.policy_version))
        await self._summary(batch, sender, results)
        if banned:
            await self._ban_notice(sender, results[0].rollout_id,
                                   f"reputation {self.reputation.score(sender):.1f}; last "
                                   f"reject: {first_reject.reason if first_reject else '-'}")

    async def _summary(self, batch, sender: str, results) -> None:
        """One signed summary verdict per verified batch to its sender (how many accepted,
        rejects by reason), so an honest peer sees what happens to its work."""
        if not results or sender == self.own_id:
            return
        reasons = Counter(r.reason for r in results if not r.accept)
        n_ok = sum(1 for r in results if r.accept)
        await self._publish(Verdict(
            rollout_id=results[0].rollout_id, subject=sender, accept=n_ok > 0,
            reason=SUMMARY_REASON, policy_version=batch.policy_version,
            detail=summary_detail(n_ok, reasons, batch.round)))

    async def _ban_notice(self, peer: str, rollout_id: bytes, detail: str) -> None:
        """Tell a banned peer, at most once per `ban_notice_s`."""
        now = self.clock()
        if now - self._told_banned.get(peer, -1e18) < self.limits.ban_notice_s:
            return
        self._told_banned[peer] = now
        self._told_banned.move_to_end(peer)
        while len(self._told_banned) > self.limits.max_budget_peers:
            self._told_banned.popitem(last=False)
        await self._publish(Verdict(rollout_id=rollout_id, subject=peer, accept=False,
                                    reason="banned", policy_version=0, detail=detail[:512]))

    async def _publish(self, verdict: Verdict) -> None:
        try:
            await self.ports.publish(verdict)
        except Exception as e:  # noqa: BLE001 - feedback only; counted
            self.state.count("verdict_publish_failed")
            log.debug("verdict to %s not published: %s", verdict.subject[-8:], e)


def _all(batch: RolloutBatch, reason: str, detail: str) -> list[RolloutResult]:
    return [RolloutResult(i, rollout_id(batch, c), False, reason, detail)
            for i, c in enumerate(batch.completions)]


def _condemned(results: list[RolloutResult], alarm: Alarm) -> list[RolloutResult]:
    """The batch's results once a sequential test condemned it: nothing of it is used."""
    return [RolloutResult(r.index, r.rollout_id, False, alarm.reason,
                          f"sequential test ({alarm.test})") if r.accept else r
            for r in results]


def _verified_completion(c, result: RolloutResult):
    """The completion as the trainer may use it: decoded text, recomputed logprobs (NaN for
    a spot-check-skipped one: recomputed by the trainer), recomputed reward."""
    n = c.completion_ids.shape[0]
    logprobs = result.logprobs if result.logprobs is not None \
        else np.full(n, np.nan, dtype=np.float32)
    return c.model_copy(update={"text": result.text or "",
                                "logprobs": TensorData.from_numpy(
                                    np.asarray(logprobs, dtype=np.float32)),
                                "claimed_reward": float(result.reward or 0.0)})
