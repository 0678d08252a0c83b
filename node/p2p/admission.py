"""Who pays for a gossip message: its origin (the signed envelope sender), and the connection
that first brought us a new origin; never an honest peer that relays it.

Called from the libp2p thread. `admit` runs before pubsub spends anything on a message
(patches/spawn_gate.py: no task, no signature check, no decode yet), so it only knows the
*claimed* origin (`from` field); `accept` runs in the topic validator once the pubsub and
envelope signatures proved the origin.

Before verification (admit), in order:
1. copies of messages already validated are dropped (`gossip_duplicates`);
2. a claimed origin that our penalties refuse is dropped (`banned`);
3. per (connection, claimed origin) token bucket at the topic's per-origin rate: a relay
   forwarding an honest origin stays within it; an attacker that forges an honest origin's
   `from` only drains its own connection's bucket for that origin. Over it the message is
   dropped and counted against the origin (`rate_limited`), nobody penalised;
4. a claimed origin never accepted here before (a *new* origin) takes a token from its
   connection's new-origin bucket: a connection that keeps introducing fresh identities is
   throttled to NEW_ORIGINS_PER_S (`new_origin_throttled`), never cut, and origins already
   known keep flowing through it (an honest relay of a sybil flood still relays the honest
   peers). Each origin reported for bad work takes NEW_ORIGIN_CHARGE more tokens from the
   connection that introduced it;
5. a per-topic budget for the whole node (`GLOBAL_RATES`, messages/s) with max-min fair
   shares: while the node receives less than the budget everything passes; above it, a
   message is admitted if its connection's subnet (/24, /48) is below the subnet share
   (budget / active subnets), or else if its (connection, origin) flow is below the flow
   share (the subnet share / the subnet's active flows). Many identities behind one subnet
   get that subnet's share, a flood spread over many flows their flows' shares, and light
   honest flows pass whole (`over_budget`), bursts included: a flow under its share banks
   up to FairShare.BURST_S seconds of it (a relay's stall bunching its messages costs it
   nothing); what honest flows leave unused, the flood may use. Origins the `established(peer)` callable names (peers with verified history, from
   the verifier) skip the fair shares.

The trainers this node follows (`followed(peer)`, from the broadcaster) on the topics of
their own publication (FOLLOWED_KINDS: manifests, adverts) skip the fair shares and the
per-origin rate after verification, and their (connection, origin) bucket runs at
FOLLOWED_RATE_FACTOR times the topic's rate: a trainer stepping faster than the topic rate
is never throttled into stalling its followers, while forged or replayed copies of its
messages on one connection stay bounded (a forged signature is charged to the connection,
a replay costs one signature check).

After verification (accept): per-origin token bucket (across connections) at the topic's
per-origin rate; over it the message is rejected and counted against the origin
(`rate_limited`).

Rate alone never costs penalty points: every drop above is cheap (before any signature
check) or bounded (by the rates), and an honest trainer or relay publishing in bursts (back
to back steps, a joiner's catch-up, a restart) must never be cut by its own followers.
Penalties are for what only a faulty or hostile peer sends (penalties.POINTS) and for bad
work the layers above report against an origin.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable

import trio

from ...protocol.limits import DEFAULT_TOPIC_RATES, OTHER_TOPIC_RATE, TopicRate
from .gossip import origin_b58
from .penalties import PeerPenalties, TokenBuckets

log = logging.getLogger(__name__)

GLOBAL_RATES: dict[str, float] = {
    "rollouts": 200.0, "verdicts": 300.0, "adverts": 100.0, "checkpoints": 20.0,
}
"""Messages/s of each topic this node validates before fair shares apply (first copies;
sized above a swarm's honest traffic and below what one node validates on one core)."""
OTHER_GLOBAL_RATE = 50.0
FOLLOWED_KINDS = frozenset({"checkpoints", "adverts"})
FOLLOWED_RATE_FACTOR = 10.0
"""A followed trainer's (connection, origin) bucket on FOLLOWED_KINDS: this many times the
topic's per-origin rate and burst (checkpoints: 20 manifests/s, 200 at once)."""
NEW_ORIGINS_PER_S = 2.0
NEW_ORIGINS_BURST = 32.0
"""New origins one connection may introduce: per second, and at once."""
NEW_ORIGIN_CHARGE = 4.0
"""Tokens a connection loses from its new-origin bucket per origin it introduced that was
then reported for bad work (so 10 reported sybils cost it ~20 s of introductions)."""
KNOWN_ORIGINS = 16384
LOG_EVERY_S = 10.0
MAX_CONNECTIONS_PER_SUBNET = 64
"""Peers connected from one subnet (/24, /48) at once; peers with verified history
(`established`) are admitted beyond it (a reserve for known peers)."""
QUEUE_BYTES = 64 * 1024 * 1024
QUEUE_MESSAGES = 4096
"""Received messages admitted and waiting for validation (all flows): bytes, messages."""
FLOW_QUEUE_BYTES = 8 * 1024 * 1024
FLOW_QUEUE_MESSAGES = 512
"""What one (connection, origin) flow may have waiting (an honest burst: the per-origin
bucket's 500): a flood waits behind its own flow's cap and is dropped there, while every
other flow is served in turn."""
NEW_INBOUND_PER_S = 4.0
NEW_INBOUND_BURST = 16.0
"""New inbound connections one subnet (/24, /48) may have upgraded: per second, and at
once. Counted at TCP accept, before the Noise handshake (AcceptGate)."""
INBOUND_WAITING = 64
INBOUND_WAIT_S = 8.0
"""Accepted connections of one subnet that may wait for a token, and for how long (under
the dialer's 10 s dial timeout); past either they are closed."""
TRUSTED_IPS = 1024


def topic_kind(topic: str) -> str:
    """The kind of /swarm-node/<swarm>/<kind>/1 (the topic itself otherwise)."""
    parts = topic.rsplit("/", 2)
    return parts[-2] if len(parts) == 3 else topic


class FairShare:
    """Max-min fair admission against a global rate, in two levels: groups (subnets), then
    keys (flows) within a group. Over the rate, a message passes if its group is below the
    group share (rate / active groups), or else if its key is below the key share (the group
    share / the group's active keys); under the rate, everything passes (work-conserving: a
    flood gets what honest flows leave). Rates are estimated over a sliding window of two WINDOW_S
    buckets; memory is bounded by `max_keys` keys per window (past it keys share one).

    A key over its share still passes on its burst allowance: a token bucket per key, refilled
    at the key's share (the share as it stands at each refill), BURST_S deep, from which every
    message of the key admitted by any path takes a token (down to a debt of BURST_S seconds of
    its share). A light flow (below its share) saves up to BURST_S seconds of it, so a burst
    its sender or a relay's stall bunched into one window passes whole; a flood flow is in debt
    (what the window let through at or over its share) and gets no allowance; a new key starts
    with none (no more than before the allowance)."""

    WINDOW_S = 1.0
    BURST_S = 4.0

    def __init__(self, rate: float, *, clock: Callable[[], float] = time.monotonic,
                 max_keys: int = 65536):
        self.rate = rate
        self.clock = clock
        self.max_keys = max_keys
        self._window = -1
        self._cur: dict[tuple, int] = {}  # (group, key) -> messages this window
        self._prev: dict[tuple, int] = {}
        self._cur_group: dict[object, int] = {}
        self._prev_group: dict[object, int] = {}
        self._prev_keys: dict[object, int] = {}  # group -> keys seen in the last window
        self._new_keys: dict[object, int] = {}  # group -> keys new in this window
        self._new_groups = 0
        self._cur_total = 0
        self._prev_total = 0
        self._tokens: OrderedDict[tuple, list[float]] = OrderedDict()  # slot -> [tokens, at]

    def _roll(self, now: float) -> float:
        window = int(now // self.WINDOW_S)
        if window != self._window:
            if window == self._window + 1:
                self._prev, self._prev_group = self._cur, self._cur_group
                self._prev_total = self._cur_total
            else:
                self._prev, self._prev_group, self._prev_total = {}, {}, 0
            self._prev_keys = {}
            for group, _ in self._prev:
                self._prev_keys[group] = self._prev_keys.get(group, 0) + 1
            self._cur, self._cur_group, self._cur_total = {}, {}, 0
            self._new_keys, self._new_groups = {}, 0
            self._window = window
        return now / self.WINDOW_S - window  # fraction of the current window elapsed

    def _estimate(self, cur: int, prev: int, frac: float) -> float:
        return (cur + prev * (1.0 - frac)) / self.WINDOW_S

    def _slot(self, key: object, group: object) -> tuple:
        slot = (group, key)
        if slot not in self._cur and len(self._cur) >= self.max_keys:
            return ("<overflow>", "<overflow>")
        return slot

    def active(self) -> int:
        """Groups active in the window."""
        return len(self._prev_group) + self._new_groups

    def _shares(self, slot: tuple) -> tuple[float, float]:
        """(the share of the slot's group, the slot's share within it), counting them in."""
        group = slot[0]
        new_group = group not in self._cur_group and group not in self._prev_group
        group_share = self.rate / max(1, self.active() + new_group)
        new_key = slot not in self._cur and slot not in self._prev
        keys = self._prev_keys.get(group, 0) + self._new_keys.get(group, 0) + new_key
        return group_share, group_share / max(1, keys)

    def _refill(self, slot: tuple, share: float, now: float) -> list[float] | None:
        entry = self._tokens.get(slot)
        if entry is not None:
            entry[0] = min(self.BURST_S * share, entry[0] + (now - entry[1]) * share)
            entry[1] = now
        return entry

    def check(self, key: object, group: object = "") -> bool:
        """Within the budget, below both fair shares, or on the key's burst allowance
        (nothing recorded)."""
        now = self.clock()
        frac = self._roll(now)
        if self._estimate(self._cur_total, self._prev_total, frac) < self.rate:
            return True
        slot = self._slot(key, group)
        group = slot[0]
        group_share, share = self._shares(slot)
        if self._estimate(self._cur_group.get(group, 0), self._prev_group.get(group, 0),
                          frac) < group_share:
            return True  # a group under its share passes whole
        if self._estimate(self._cur.get(slot, 0), self._prev.get(slot, 0), frac) < share:
            return True
        entry = self._refill(slot, share, now)
        return entry is not None and entry[0] >= 1.0  # its burst allowance

    def record(self, key: object, group: object = "") -> None:
        """One message of `key` (in `group`) admitted."""
        now = self.clock()
        self._roll(now)
        slot = self._slot(key, group)
        share = self._shares(slot)[1]
        entry = self._refill(slot, share, now)
        if entry is None:
            entry = self._tokens[slot] = [0.0, now]
            while len(self._tokens) > self.max_keys:
                self._tokens.popitem(last=False)
        else:
            self._tokens.move_to_end(slot)
        entry[0] = max(-self.BURST_S * share, entry[0] - 1.0)  # in debt: no allowance
        group = slot[0]
        if slot not in self._cur:
            if slot not in self._prev:
                self._new_keys[group] = self._new_keys.get(group, 0) + 1
            self._cur[slot] = 0
        if group not in self._cur_group:
            self._new_groups += group not in self._prev_group
            self._cur_group[group] = 0
        self._cur[slot] += 1
        self._cur_group[group] += 1
        self._cur_total += 1

    def allow(self, key: object, group: object = "") -> bool:
        if not self.check(key, group):
            return False
        self.record(key, group)
        return True


def subnet_of(ip: str | None) -> str:
    """The /24 of an IPv4 address, the /48 of an IPv6 one ("?" if unknown): one operator's
    machines usually share it, so fair shares and connection caps bind per subnet."""
    if not ip:
        return "?"
    if ":" in ip:
        return ":".join(ip.split(":")[:3]) + "::/48"
    return ".".join(ip.split(".")[:3]) + ".0/24"


DROP_WARN_AT = 20  # drops in one log line from which it is a WARNING (below: DEBUG)


class _Throttled:
    """One log line per (connection, reason) per LOG_EVERY_S, with the count since the last
    (a WARNING from DROP_WARN_AT drops, DEBUG below):
    naming the origin when there was one, else the connection that carried them, how many
    origins and the last one (a flood of fresh keys is one line per carrier, not one per
    key)."""

    MAX_ORIGINS = 64  # distinct origins counted per line (then "64+"): bounded memory

    def __init__(self, clock: Callable[[], float]):
        self.clock = clock
        self._last: OrderedDict[tuple[str, str], list] = OrderedDict()

    def note(self, origin: str, reason: str, via: str) -> None:
        now = self.clock()
        entry = self._last.get((via, reason))
        if entry is None:  # [last line's time, drops since, their origins, it was a WARNING]
            entry = self._last[(via, reason)] = [now - LOG_EVERY_S, 0, set(), False]
            while len(self._last) > 4096:
                self._last.popitem(last=False)
        entry[1] += 1
        if len(entry[2]) < self.MAX_ORIGINS:
            entry[2].add(origin)
        n, origins = entry[1], len(entry[2])
        due = now - entry[0] >= LOG_EVERY_S
        # a few drops in a period are a burst (a joiner's catch-up, a restart), not a flood:
        # honest nodes must not read "my trainer floods" (#29 audit). A WARNING as soon as
        # DROP_WARN_AT drops gather, then at most one line per period; fewer: DEBUG, per period
        if n >= DROP_WARN_AT and not (entry[3] and not due):
            level = logging.WARNING
        elif due:
            level = logging.DEBUG
        else:
            return
        if origins == 1:
            log.log(level, "gossip from origin %s dropped (%s), %d message(s) in the last "
                    "%.0fs; last one via %s", origin, reason, n, now - entry[0],
                    "the origin itself" if via == origin else via)
        else:
            log.log(level, "gossip carried by %s dropped (%s): %d message(s) of %s origin(s) "
                    "in the last %.0fs; last origin %s", via, reason, n,
                    f"{origins}+" if origins >= self.MAX_ORIGINS else origins,
                    now - entry[0], origin)
        entry[0], entry[1], entry[2], entry[3] = now, 0, set(), level == logging.WARNING


class Admission:
    """The node's gossip admission: see the module docstring. Thread-safe."""

    def __init__(self, penalties: PeerPenalties, metrics, *,
                 rates: dict[str, TopicRate] | None = None,
                 global_rates: dict[str, float] | None = None,
                 established: Callable[[str], bool] | None = None,
                 followed: Callable[[str], bool] | None = None,
                 self_id: str = "",
                 clock: Callable[[], float] = time.monotonic):
        self.penalties = penalties
        self.metrics = metrics
        self.rates = dict(DEFAULT_TOPIC_RATES if rates is None else rates)
        self.global_rates = dict(GLOBAL_RATES if global_rates is None else global_rates)
        self.established = established
        self.followed = followed
        self.self_id = self_id
        self.clock = clock
        self._lock = threading.Lock()
        self._flows = TokenBuckets(clock=clock, max_buckets=65536)  # (conn, origin, kind)
        self._origins = TokenBuckets(clock=clock, max_buckets=16384)  # (origin, kind)
        self._introduce = TokenBuckets(clock=clock, max_buckets=16384)  # conn
        self._fair: dict[str, FairShare] = {}  # per topic kind: subnets, then flows
        self._subnet: OrderedDict[str, str] = OrderedDict()  # connection -> subnet
        self._by_subnet: dict[str, set[str]] = {}  # subnet -> connected peers
        self.max_per_subnet = MAX_CONNECTIONS_PER_SUBNET
        self._known: OrderedDict[str, None] = OrderedDict()
        self._introduced_by: OrderedDict[str, str] = OrderedDict()  # new origin -> conn
        self._log = _Throttled(clock)
        self.accept_gate = AcceptGate(metrics, clock=clock)

    def set_established(self, fn: Callable[[str], bool] | None) -> None:
        """`fn(peer) -> bool`: True for peers with verified history (fast, thread-safe)."""
        self.established = fn

    def set_followed(self, fn: Callable[[str], bool] | None) -> None:
        """`fn(peer) -> bool`: True for the trainers this node follows (fast, thread-safe)."""
        self.followed = fn

    # Before verification ------------------------------------------------------------------

    def admit(self, forwarder, msg, duplicate: bool) -> bool:
        """patches.spawn_gate's hook: may pubsub spend a task on this received message?"""
        self.metrics.inc("gossip_copies_in")
        if duplicate:
            self.metrics.inc("gossip_duplicates")
            return False
        conn = forwarder.to_base58()
        try:
            origin = origin_b58(msg.from_id)
        except Exception:  # noqa: BLE001 - not a peer id: the validator rejects it, counted
            return True
        with self._lock:
            return all(self._admit(conn, origin, topic_kind(t)) for t in msg.topicIDs)

    def _admit(self, conn: str, origin: str, kind: str) -> bool:
        if origin == self.self_id:
            # Our own messages coming back: after a restart the seen-cache is empty and peers
            # still forward the previous run's messages. Nothing to process, nobody to charge,
            # nothing to warn about (it read as a flood of "new origins": this node itself).
            self.metrics.inc("gossip_own_echoes")
            return False
        if self.penalties.refused(origin):
            self.metrics.reject(origin, "banned")
            return False
        rate = self.rates.get(kind, OTHER_TOPIC_RATE)
        followed = kind in FOLLOWED_KINDS and self._follows(origin)
        if followed:
            rate = TopicRate(per_s=rate.per_s * FOLLOWED_RATE_FACTOR,
                             burst=rate.burst * FOLLOWED_RATE_FACTOR)  # one tiny object
        if not self._flows.take((conn, origin, kind), rate):
            return self.drop(origin, conn, "rate_limited")
        if origin not in self._known and origin != conn:
            if not self._introduce.take(conn, _NEW_ORIGINS):
                return self.drop(origin, conn, "new_origin_throttled")
            self._introduced_by[origin] = conn
            self._introduced_by.move_to_end(origin)
            while len(self._introduced_by) > KNOWN_ORIGINS:
                self._introduced_by.popitem(last=False)
        if followed or self.is_priority(origin):
            return True
        fair = self._fair.get(kind)
        if fair is None:
            fair = self._fair[kind] = FairShare(self.global_rates.get(kind, OTHER_GLOBAL_RATE),
                                                clock=self.clock)
        if not fair.allow((conn, origin), self._subnet.get(conn, "?")):
            return self.drop(origin, conn, "over_budget")
        return True

    def connected(self, conn: str, ip: str | None) -> bool:
        """A connection to peer `conn` from `ip` opened: False if its subnet already holds
        MAX_CONNECTIONS_PER_SUBNET other peers and `conn` has no verified history (then the
        caller closes it). Fair shares are per subnet, too."""
        subnet = subnet_of(ip)
        priority = self.is_priority(conn)
        if priority:
            self.accept_gate.trust(ip)
        with self._lock:
            peers = self._by_subnet.setdefault(subnet, set())
            if not priority:  # known peers use the reserve: never counted
                if conn not in peers and len(peers) >= self.max_per_subnet:
                    return False
                peers.add(conn)
            self._subnet[conn] = subnet
            self._subnet.move_to_end(conn)
            while len(self._subnet) > KNOWN_ORIGINS:
                self._subnet.popitem(last=False)
        return True

    def disconnected(self, conn: str) -> None:
        """The last connection to peer `conn` closed."""
        with self._lock:
            subnet = self._subnet.get(conn)
            peers = self._by_subnet.get(subnet)
            if peers is not None:
                peers.discard(conn)
                if not peers:
                    del self._by_subnet[subnet]

    def is_priority(self, origin: str) -> bool:
        fn = self.established
        if fn is None:
            return False
        try:
            return bool(fn(origin))
        except Exception:  # noqa: BLE001 - a failing signal gives no priority, never a drop
            return False

    def _follows(self, origin: str) -> bool:
        fn = self.followed
        if fn is None:
            return False
        try:
            return bool(fn(origin))
        except Exception:  # noqa: BLE001 - a failing signal exempts nothing, never a drop
            return False

    def drop(self, origin: str, conn: str, reason: str) -> bool:
        """Count (against the origin) and log a dropped message; False."""
        self.metrics.reject(origin, reason)
        self._log.note(origin, reason, conn)
        return False

    # After verification -------------------------------------------------------------------

    def accept(self, origin: str, kind: str) -> bool:
        """The topic validator, once the origin is proven: its per-origin rate. False: the
        message is rejected, counted against the origin (no penalty, never the forwarder)."""
        with self._lock:
            ok = ((kind in FOLLOWED_KINDS and self._follows(origin))  # proven: never throttled
                  or self._origins.take((origin, kind), self.rates.get(kind, OTHER_TOPIC_RATE)))
            if ok:
                self._known[origin] = None
                self._known.move_to_end(origin)
                while len(self._known) > KNOWN_ORIGINS:
                    self._known.popitem(last=False)
        if not ok:
            self.metrics.reject(origin, "rate_limited")
            self._log.note(origin, "rate_limited", origin)
        return ok

    def reported(self, origin: str, n: int = 1) -> str | None:
        """The work layer found `n` offences in `origin`'s messages: it is no longer a known
        origin, and the connection that introduced it (if any, and if not the origin itself)
        loses NEW_ORIGIN_CHARGE new-origin tokens per offence. Returns that connection."""
        with self._lock:
            self._known.pop(origin, None)
            conn = self._introduced_by.get(origin)
            if conn is not None and conn != origin:
                self._introduce.charge(conn, _NEW_ORIGINS, NEW_ORIGIN_CHARGE * n)
        return conn

    def known(self, origin: str) -> bool:
        with self._lock:
            return origin in self._known

    def introducer(self, origin: str) -> tuple[str, str]:
        """(connection, its subnet) in whose turn `origin`'s work waits (the verifier's
        probation lane): the origin itself once it has (had) a connection of its own to this
        node, whatever connection its messages take; else the connection that first brought
        it as a new origin; else itself (its introduction was forgotten: LRU). The subnet is
        the connection's, "?" where it is not known.

        So an honest newcomer whose first message came through a carrier that also brings a
        flood of fresh keys leaves the carrier's turn as soon as it connects here itself. This
        buys an attacker nothing it could not buy before: a key that connects here itself was
        always its own introducer (had it connected first), and the connection is what costs
        (inbound ones paced per subnet at accept, AcceptGate; all capped per subnet,
        MAX_CONNECTIONS_PER_SUBNET; our dials are ours to choose), and its turn is still
        within its subnet's. Copies relayed by other connections never move an origin
        (the first introducer stays, however the flood is re-routed through honest relays)."""
        with self._lock:
            conn = origin if origin in self._subnet else self._introduced_by.get(origin, origin)
            return conn, self._subnet.get(conn, "?")


_NEW_ORIGINS = TopicRate(per_s=NEW_ORIGINS_PER_S, burst=NEW_ORIGINS_BURST)


class AcceptGate:
    """Which new inbound TCP connections this node upgrades, and when (patches/accept_gate.py
    calls `t_admit` at accept, before multistream and the Noise handshake).

    Each subnet (/24, /48: `subnet_of`) may have NEW_INBOUND_BURST new inbound connections
    upgraded at once and NEW_INBOUND_PER_S more per second (a token bucket per subnet).
    Past that a connection waits, in arrival order behind its subnet's other waiters, for
    its subnet's next token: at most INBOUND_WAITING of them, each at most INBOUND_WAIT_S;
    past either, or when the dialer gave up meanwhile, it is closed unread (counted
    `connections_refused_accept`, `connections_gone_waiting`). A refused or waiting
    connection costs an accept and a sleeping task, not a handshake, identify, pubsub's hello
    and a peer-exchange Hello. Many identities behind one address or subnet share its pace,
    so fresh keys buy an attacker nothing: a churning flood gets NEW_INBOUND_PER_S
    identities a second in, and a dialer that waits its turn (an honest newcomer behind the
    flood's address) connects within INBOUND_WAIT_S instead of being refused. An honest
    subnet (a home router, a lab host) never meets the bound; a joiner's burst fits in it.
    Exempt: addresses from which a peer with verified history (`Admission.established`)
    connected (`trust`), so such a peer reconnects whatever a flood from its subnet does.
    Connections already open are never touched; our own dials are not gated."""

    def __init__(self, metrics, *, per_s: float = NEW_INBOUND_PER_S,
                 burst: float = NEW_INBOUND_BURST, waiting: int = INBOUND_WAITING,
                 wait_s: float = INBOUND_WAIT_S, clock: Callable[[], float] = time.monotonic):
        self.metrics = metrics
        self.rate = TopicRate(per_s=per_s, burst=burst)
        self.waiting, self.wait_s = waiting, wait_s
        self.clock = clock
        self._lock = threading.Lock()
        self._buckets = TokenBuckets(clock=clock, max_buckets=16384)
        self._trusted: OrderedDict[str, None] = OrderedDict()
        self._queues: dict[str, list] = {}  # subnet -> [trio.Lock (FIFO), waiters]
        self._refused: dict[str, list] = {}  # subnet -> [last log line's time, refused since]

    def allow(self, ip: str | None) -> bool:
        """A token for a new inbound connection from `ip` now, without waiting (trusted
        addresses need none)."""
        with self._lock:
            return (ip is not None and ip in self._trusted) or self._buckets.take(
                subnet_of(ip), self.rate)

    async def t_admit(self, ip: str | None, gone: Callable[[], bool]) -> bool:
        """May the connection just accepted from `ip` be upgraded? Waits for its subnet's
        turn (see the class); `gone()` says whether the dialer closed it meanwhile. Libp2p
        thread only."""
        subnet = subnet_of(ip)
        queue = self._queues.get(subnet)
        if (queue is None or self.trusted(ip)) and self.allow(ip):  # no need to queue
            return True
        if (queue[1] if queue else 0) >= self.waiting:
            return self._refuse(subnet, "connections_refused_accept")
        if queue is None:
            queue = self._queues[subnet] = [trio.Lock(), 0]
        queue[1] += 1
        self.metrics.inc("connections_deferred_accept")
        try:
            with trio.move_on_after(self.wait_s):
                async with queue[0]:  # trio's Lock is fair: arrival order
                    while True:
                        if gone():
                            return self._refuse(subnet, "connections_gone_waiting")
                        if self.allow(ip):
                            return True
                        await trio.sleep(1.0 / self.rate.per_s)
            return self._refuse(subnet, "connections_refused_accept")
        finally:
            queue[1] -= 1
            if queue[1] == 0 and self._queues.get(subnet) is queue:
                del self._queues[subnet]

    def trusted(self, ip: str | None) -> bool:
        with self._lock:
            return ip is not None and ip in self._trusted

    def trust(self, ip: str | None) -> None:
        """A peer with verified history connected from `ip`: never make it wait."""
        if ip is None:
            return
        with self._lock:
            self._trusted[ip] = None
            self._trusted.move_to_end(ip)
            while len(self._trusted) > TRUSTED_IPS:
                self._trusted.popitem(last=False)

    def _refuse(self, subnet: str, counter: str) -> bool:
        self.metrics.inc(counter)
        now = self.clock()
        entry = self._refused.get(subnet)
        if entry is None:
            if len(self._refused) > 4096:
                self._refused.clear()
            entry = self._refused[subnet] = [now - LOG_EVERY_S, 0]
        entry[1] += 1
        if now - entry[0] >= LOG_EVERY_S:
            log.warning("closed %d new inbound connection(s) from %s unread in the last %.0fs "
                        "(over %g new connections/s per subnet, burst %g, %d waiting at "
                        "most %gs)", entry[1], subnet, now - entry[0], self.rate.per_s,
                        self.rate.burst, self.waiting, self.wait_s)
            entry[0], entry[1] = now, 0
        return False


class ValidationQueue:
    """Admitted messages waiting for pubsub's validation tasks (patches/spawn_gate.py):
    one FIFO per (connection, origin) flow, served round robin (one message per flow per
    turn), origins with verified history (`Admission.established`) first. Bounded per flow
    (FLOW_QUEUE_MESSAGES, FLOW_QUEUE_BYTES) and in total (QUEUE_BYTES): a full flow drops
    its newcomer; a full queue drops the newest message of the longest flow (which is the
    newcomer's own when it is the longest). Used from the libp2p thread only."""

    def __init__(self, admission: Admission, *, max_bytes: int = QUEUE_BYTES,
                 max_messages: int = QUEUE_MESSAGES, flow_bytes: int = FLOW_QUEUE_BYTES,
                 flow_messages: int = FLOW_QUEUE_MESSAGES):
        self.admission = admission
        self.metrics = admission.metrics
        self.max_bytes = max_bytes
        self.max_messages = max_messages
        self.peak_bytes = 0
        self.peak_messages = 0
        self._count = 0
        self.flow_bytes = flow_bytes
        self.flow_messages = flow_messages
        self._flows: OrderedDict[tuple[str, str], deque] = OrderedDict()  # in turn order
        self._priority: deque = deque()
        self._sizes: dict[tuple[str, str], int] = {}
        self._bytes = 0
        self._wakeup: trio.Event | None = None

    def __len__(self) -> int:
        return self._count

    @property
    def queued_bytes(self) -> int:
        return self._bytes

    def put(self, forwarder, msg) -> bool:
        conn = forwarder.to_base58()
        try:
            origin = origin_b58(msg.from_id)
        except Exception:  # noqa: BLE001 - not a peer id: its own flow, rejected later
            origin = "?"
        size = len(msg.data) + 64
        if self.admission.is_priority(origin):
            key = None
            if len(self._priority) >= 4 * self.flow_messages:
                return self._dropped(origin, conn)
        else:
            key = (conn, origin)
            queue = self._flows.get(key)
            held = self._sizes.get(key, 0)
            if queue is not None and (len(queue) >= self.flow_messages
                                      or held + size > self.flow_bytes):
                return self._dropped(origin, conn)
        while self._bytes + size > self.max_bytes:
            longest = max(self._flows, key=lambda k: self._sizes[k], default=None)
            if longest is None or longest == key:
                return self._dropped(origin, conn)
            self._evict(longest)
        while self._count >= self.max_messages:
            longest = max(self._flows, key=lambda k: len(self._flows[k]), default=None)
            if longest is None or longest == key:
                return self._dropped(origin, conn)
            self._evict(longest)
        if key is None:
            self._priority.append((forwarder, msg, size))
        else:
            self._flows.setdefault(key, deque()).append((forwarder, msg, size))
            self._sizes[key] = self._sizes.get(key, 0) + size
        self._bytes += size
        self._count += 1
        self.peak_bytes = max(self.peak_bytes, self._bytes)
        self.peak_messages = max(self.peak_messages, self._count)
        if self._wakeup is not None:
            self._wakeup.set()
        return True

    def _evict(self, key) -> None:
        queue = self._flows[key]
        _, _, size = queue.pop()  # its newest
        self._account(key, queue, size)
        self._dropped(key[1], key[0])

    def _account(self, key, queue: deque, size: int) -> None:
        self._bytes -= size
        self._count -= 1
        self._sizes[key] -= size
        if not queue:
            del self._flows[key]
            del self._sizes[key]

    def _dropped(self, origin: str, conn: str) -> bool:
        self.metrics.inc("gossip_queue_dropped")
        self.admission.drop(origin, conn, "queue_full")
        return False

    async def get(self):
        """The next (forwarder, msg) to validate, waiting for one."""
        while not self._priority and not self._flows:
            self._wakeup = trio.Event()
            await self._wakeup.wait()
        if self._priority:
            forwarder, msg, size = self._priority.popleft()
            self._bytes -= size
            self._count -= 1
            return forwarder, msg
        key, queue = next(iter(self._flows.items()))
        forwarder, msg, size = queue.popleft()
        self._account(key, queue, size)
        if queue:
            self._flows.move_to_end(key)  # its next message waits for the other flows' turn
        return forwarder, msg
