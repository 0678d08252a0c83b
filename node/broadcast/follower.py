"""The follower side of the broadcaster: which manifests to act on (the gate, the trainer
choice), and the downloads of the versions it accepts.

One download per followed policy at a time; a newer version supersedes an unfinished one,
unless that one is kept (it superseded another, or it waited for one) and verified a shard
in the last KEEP_STALL_S: then it runs to its end and the newest version announced
meanwhile waits (`Follower.waiting`) and starts after it, kept too. Before (heal47), a
follower that needs longer for a version than the trainer takes between versions (a home
peer on a 200 ms path: 3-4 s a version, one every 1.4-2.3 s) had each download cancelled by
the next and completed none for 48 s, until the trainer's interval happened to be longer;
after heal47 and before swarm49, the version that had waited started unkept and the next
version cancelled it: such a follower completed every other download it started.
A version is accepted only if its missing bytes fit the disk beside the other downloads'
reservations (space.py). A peer that advertises a version this node does not know yet is
asked for its manifest (MANIFEST_PROTOCOL), one pull per policy at a time.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from ...protocol.envelope import Envelope
from ...protocol.ids import MANIFEST_PROTOCOL
from ...protocol.messages import CheckpointManifest, ShardRequest
from ..diskspace import DiskFull, DiskWatch, is_disk_full
from ..lifecycle import Changed, TaskOwner
from ..p2p import Transport, Verdict
from .downloader import Downloader
from .errors import DownloadFailed, ManifestRejected, StoreError
from .follow import TrainerChoice, ask_bootstrap_peers
from .manifest import AcceptedManifest, ManifestGate
from .progress import Progress
from .records import VersionRecord, VersionRecords
from .sources import NAT_HEAD_START_S, ProvenPeers, SourceBook
from .space import SpaceReservations
from .store import ShardStore, VersionEntry

log = logging.getLogger(__name__)

PULL_BACKOFF_S = 60.0
KEEP_STALL_S = 5.0
"""A kept download (it superseded or waited for another) holds newer versions back only
while it verified a shard within this long: one stuck since a partition (its sources gone)
is superseded as before. Without it (h47 run): half b's stuck downloads held the newest
version back until their 120 s stall timeout, and the heal took 104 s."""
PULL_GRACE_S = 1.0
"""A version first seen in an advert is pulled only if its manifest did not arrive by
gossip this long after (a trainer advertises a version just before gossiping its
manifest: pulling at once fetched nearly every manifest twice). The wait ends as soon as
the manifest arrives (`Follower.changed`)."""
MAX_BACKOFF_PEERS = 4096
MAX_TOLD = 256  # policies told once that they are not followed
QUIET = ("not_newer", "settings_mismatch", "no_space")  # said elsewhere, or routine
DOWNLOAD_COUNTERS = {"bytes_verified": "bytes_downloaded", "shards_ok": "shards_downloaded",
                     "bytes_fetched": "bytes_fetched", "bytes_corrupt": "bytes_corrupt",
                     "shards_corrupt": "shards_corrupt", "bytes_wasted": "bytes_wasted",
                     "shards_resumed": "shards_resumed", "disk_full": "disk_full_pauses",
                     "seeded": "fetch_seeded"}
"""Downloader metrics summed into the node's broadcast counters (and `fail_<reason>` as
`fetch_failed_<reason>`)."""


@dataclass(frozen=True)
class Completed:
    """A version downloaded, verified and assembled here."""

    manifest: CheckpointManifest
    path: Path
    fetched: int  # bytes of verified shards fetched from peers in this run
    seconds: float  # from the accepted manifest to the assembled checkpoint
    metrics: dict[str, int] = field(default_factory=dict)  # the Downloader's
    times: dict[str, float] = field(default_factory=dict)
    sources: dict[str, dict] = field(default_factory=dict)
    flights: list[tuple] = field(default_factory=list)  # the Downloader's flight_log


OnComplete = Callable[[Completed], Awaitable[None] | None]


@dataclass(eq=False)
class Job:
    """The download of one version of a policy."""

    version: int
    task: asyncio.Task
    started: float = field(default_factory=time.monotonic)
    downloader: Downloader | None = None
    kept: bool = False  # it cancelled an unfinished download or waited for one: while it
    # makes progress, newer versions wait for it


NATTED = frozenset({Verdict.RELAYED, Verdict.DIRECT, Verdict.UNREACHABLE})


def behind_nat(node) -> bool:
    """Whether this node's own reachability verdict says peers cannot dial it (relayed,
    direct by hole punching only, or unreachable): then it leaves the trainer's first
    copies to reachable followers (sources.NAT_HEAD_START_S). Not checked yet: no."""
    reach = getattr(node, "reachability", None)  # test doubles of the node may have none
    return reach is not None and reach.verdict in NATTED


class Follower:
    """`tasks`: the owner of the downloads and manifest pulls (the broadcaster's).
    `changed` fires whenever what it holds or fetches changes: a download starts or ends, a
    trainer is chosen (waiters: the manifest-pull grace, the roles' follow watch)."""

    def __init__(self, node: Transport, cfg, store: ShardStore, records: VersionRecords,
                 counters: Counter, proven: ProvenPeers, transport, *, tasks: TaskOwner,
                 follow: list[str], choice: TrainerChoice | None = None,
                 settings_check: Callable[..., str | None] | None = None,
                 interactive: bool | None = None):
        self.node, self.cfg, self.store, self.records = node, cfg, store, records
        self.counters, self.proven, self.transport = counters, proven, transport
        self.tasks = tasks
        self.changed = Changed()
        self.choice = choice  # followers without --follow: the one explicit trainer choice
        if choice is not None and choice.chosen:
            follow = [*follow, choice.chosen]
        self.gate = ManifestGate.from_config(follow, cfg, store.current_version,
                                             space_check=self._space_check,
                                             settings_check=settings_check)
        self.disk = DiskWatch("checkpoint downloads", store.root)
        self.space = SpaceReservations(store.root)
        self.interactive = interactive
        self.on_complete: OnComplete | None = None
        self.on_shard: Callable[[tuple[str, int]], None] | None = None  # adverts
        self.on_done: Callable[[tuple[str, int]], None] | None = None  # adverts
        self.jobs: dict[str, Job] = {}  # per policy: the version downloading
        # per policy: the newest version announced while a download that superseded
        # another runs (it starts when that one ends)
        self.waiting: dict[str, AcceptedManifest] = {}
        self._pulling: dict[str, int] = {}  # per policy: the version whose manifest is asked
        self._backoff: OrderedDict[str, float] = OrderedDict()  # peer -> no pulls until
        self._told: OrderedDict[str, None] = OrderedDict()

    # Manifests -----------------------------------------------------------------------

    async def on_manifest(self, env: Envelope, from_peer: str) -> None:
        try:
            accepted = self.gate.check_envelope(env)
        except ManifestRejected as e:
            self._rejected(e, from_peer, env.sender)
            return
        self.start(accepted)

    def accept_bytes(self, data: bytes) -> AcceptedManifest:
        """Check a sealed manifest from elsewhere (a file, a manifest request) and start
        downloading it. Raises ManifestRejected."""
        accepted = self.gate.check_bytes(data)
        self.start(accepted)
        return accepted

    def _rejected(self, e: ManifestRejected, from_peer: str, sender: str,
                  pulled: bool = False) -> None:
        """One line for a rejection that needs a look (a followed trainer's manifest that
        fails; INFO for one pulled from an advertiser, who may be anyone); routine ones
        at DEBUG. Every rejection is counted by the gate."""
        if e.reason == "not_followed":
            self._not_followed(sender)
            return
        level = logging.DEBUG if e.reason in QUIET else logging.INFO if pulled \
            else logging.WARNING
        log.log(level, "%s (from %s)", e, from_peer[-8:])

    def _not_followed(self, trainer: str) -> None:
        """Say once per trainer (while a choice is made: not at all) that its manifests are
        ignored; counted in the gate's `rejected` either way."""
        if self.choice is not None and self.choice.deciding or trainer in self._told:
            return
        self._told[trainer] = None
        while len(self._told) > MAX_TOLD:
            self._told.popitem(last=False)
        log.info("ignoring the checkpoints of trainer %s: not followed here (following %s; "
                 "pass --follow to change)", trainer[-8:],
                 ", ".join(sorted(p[-8:] for p in self.gate.follow)) or "none")

    def _space_check(self, m: CheckpointManifest) -> None:
        """Gate check: the missing bytes must fit beside the other downloads'
        reservations, with the margin; raises DiskFull, so the manifest is refused before
        any byte is written."""
        entry = self.store.get(m.policy_id, m.version)
        have = entry.verified_bytes() if entry is not None else 0
        try:
            self.space.check((m.policy_id, m.version), m.total_size - have)
        except DiskFull as e:
            self.disk.hit(e)
            raise

    # Downloads -----------------------------------------------------------------------

    def start(self, accepted: AcceptedManifest, *, waited: bool = False) -> None:
        """Download `accepted`'s version, or hold it to start next (see the module's
        docstring). `waited`: it waited in `waiting` for the download before it."""
        m = accepted.manifest
        key = (m.policy_id, m.version)
        current = self.jobs.get(m.policy_id)
        waiting = self.waiting.get(m.policy_id)
        if waiting is not None and waiting.manifest.version >= m.version:
            return
        if current is not None:
            if current.version >= m.version:
                return
            if current.kept and not self._stalled(current):
                # it runs to its end: the newest version waits for it
                self.waiting[m.policy_id] = accepted
                self.counters["downloads_deferred"] += 1
                log.info("policy %s v%d waits: v%d is kept (it superseded or waited for "
                         "another and is making progress)", m.policy_id[-8:], m.version,
                         current.version)
                return
            current.task.cancel()  # a newer version supersedes an unfinished one
            self.space.release((m.policy_id, current.version))  # even if it never ran
            self.counters["downloads_superseded"] += 1
        self.waiting.pop(m.policy_id, None)
        if self.store.current_version(m.policy_id) >= m.version:
            return
        entry = self.store.get(*key)
        self.space.reserve(key, m.total_size - (entry.verified_bytes() if entry else 0))
        self.counters["downloads_started"] += 1
        self.jobs[m.policy_id] = Job(m.version, self.tasks.spawn(
            self._download_then_next(accepted), f"download {m.policy_id[-8:]} v{m.version}"),
            kept=current is not None or waited)
        self.changed.fire()

    def resume(self) -> None:
        """Resume the unfinished downloads of followed policies found on disk (their swarm
        settings checked again: the check binds them to the version, and this node's
        settings may have changed since)."""
        check = self.gate.settings_check
        for entry in list(self.store.entries.values()):
            m = entry.manifest
            if (not entry.complete and self.gate.follows(m.policy_id)
                    and m.version > self.store.current_version(m.policy_id)
                    and (check is None or check(m.settings, m.policy_id, m.version) is None)):
                self.start(AcceptedManifest(m, entry.envelope, m.policy_id))

    async def _open_entry(self, accepted: AcceptedManifest) -> VersionEntry:
        """Create (or resume) the version on disk; waits while the disk is full."""
        while True:
            try:
                return await asyncio.to_thread(self.store.open_version, accepted)
            except OSError as e:
                if not is_disk_full(e):
                    raise StoreError(f"cannot create the version on disk: {e}") from e
                self.disk.hit(e)
            await self.disk.wait_for_space(accepted.manifest.total_size)

    def _downloader(self, accepted: AcceptedManifest, entry: VersionEntry,
                    rec: VersionRecord) -> Downloader:
        m = accepted.manifest
        rec.book = book = SourceBook(per_source=self.cfg.per_source_downloads,
                                     max_corrupt=self.cfg.max_corrupt_per_source,
                                     trial_slots=max(1, self.cfg.parallel_downloads // 2),
                                     trial_failures=self.cfg.trial_failures)
        book.add(m.policy_id, None, origin=True)  # the trainer holds its own checkpoint
        if behind_nat(self.node):  # reachable followers take the trainer's first copies
            book.origin_not_before = book.clock() + NAT_HEAD_START_S
        for peer, holdings in rec.holders.items():
            book.add(peer, holdings, proven=peer in self.proven)
        progress = Progress(f"policy {m.policy_id[-8:]} v{m.version}", m.total_size,
                            interactive=self.interactive)
        on_shard = self.on_shard
        return Downloader(self.store, entry, self.transport, book, self.cfg,
                          on_shard=(lambda i, k=rec.key: on_shard(k)) if on_shard else None,
                          progress=progress, disk=self.disk, on_verified=self.proven.add,
                          space=self.space)

    @staticmethod
    def _stalled(job: Job) -> bool:
        d = job.downloader
        last = d.last_progress if d is not None else job.started
        return time.monotonic() - last > KEEP_STALL_S

    async def _download_then_next(self, accepted: AcceptedManifest) -> None:
        """Download `accepted`'s version; then start the version that waited for it, if
        any. Not when cancelled (superseded, or the node stopping) nor when another
        download took its place meanwhile: the waiting version is then that one's. Before
        (heal48), a superseded download took the waiting version with it when it ended: one
        deferred behind its successor while it unwound (its streams closing, up to
        CLOSE_TIMEOUT_S) was dropped until the trainer's next version."""
        policy = accepted.manifest.policy_id
        await self._download(accepted)
        if policy in self.jobs:  # superseded as it ended: not this one's to start
            return
        nxt = self.waiting.pop(policy, None)
        if nxt is not None:
            self.start(nxt, waited=True)

    async def _download(self, accepted: AcceptedManifest) -> None:
        m = accepted.manifest
        key = (m.policy_id, m.version)
        job = self.jobs[m.policy_id]
        d = None
        try:
            entry = await self._open_entry(accepted)
            rec = self.records.track(key)
            if rec is None:  # a newer version completed meanwhile
                return
            d = job.downloader = self._downloader(accepted, entry, rec)
            path = await d.run()
        except (DownloadFailed, StoreError) as e:
            self.counters["downloads_failed"] += 1
            log.error("policy %s v%d failed: %s", m.policy_id[-8:], m.version, e)
            return
        finally:
            self.space.release(key)
            if d is not None:
                self._fold(d)
            rec = self.records.get(key)
            if rec is not None:
                rec.book = None
            if self.jobs.get(m.policy_id) is job:
                del self.jobs[m.policy_id]
            self.changed.fire()
        self.counters["downloads_completed"] += 1
        await asyncio.to_thread(self.store.prune, m.policy_id)
        self.records.settle(m.policy_id)
        done = Completed(m, path, d.metrics["bytes_verified"], time.monotonic() - job.started,
                         dict(d.metrics), dict(d.times), d.book.summary(), list(d.flight_log))
        if self.on_complete is not None:
            try:
                result = self.on_complete(done)
                if asyncio.iscoroutine(result):
                    await result
            except Exception:  # the consumer's fault; the version stays served
                log.exception("on_complete for policy %s v%d failed", m.policy_id[-8:],
                              m.version)
        if self.on_done is not None:
            self.on_done(key)
        self.changed.fire()  # handed over: held here now

    def _fold(self, d: Downloader) -> None:
        """Add a finished (or abandoned) download's metrics to the node's counters."""
        for name, total in _download_counters(d).items():
            self.counters[name] += total

    def live_counters(self) -> Counter:
        """The metrics of the downloads in flight, as node counters."""
        out: Counter = Counter()
        for job in self.jobs.values():
            if job.downloader is not None:
                out.update(_download_counters(job.downloader))
        return out

    # Sources and manifest pulls ------------------------------------------------------

    def on_source(self, rec: VersionRecord, peer: str) -> None:
        """`peer` was admitted as a source of `rec`'s version (adverts.py)."""
        job = self.jobs.get(rec.policy_id)
        if job is not None and job.version == rec.version and job.downloader is not None:
            job.downloader.sources_changed()
            return
        if (job is None and self.store.get(*rec.key) is None
                and rec.version > self.store.current_version(rec.policy_id)
                and self._may_pull(peer, rec)):
            self._pulling[rec.policy_id] = rec.version
            task = self.tasks.spawn(self._pull(peer, rec.policy_id, rec.version),
                                    f"manifest pull {rec.policy_id[-8:]} v{rec.version}")
            task.add_done_callback(lambda _t, p=rec.policy_id: self._pulling.pop(p, None))

    def _may_pull(self, peer: str, rec: VersionRecord) -> bool:
        """One manifest pull in flight per policy; an advertiser whose pull failed is not
        asked again for PULL_BACKOFF_S (fake versions cost the attacker, not us); a version
        refused for its settings is not asked for again."""
        if rec.refused or rec.policy_id in self._pulling:
            return False
        return self._backoff.get(peer, 0.0) <= time.monotonic()

    async def _pull(self, peer: str, policy_id: str, version: int) -> None:
        def arrived() -> bool:
            job = self.jobs.get(policy_id)
            return (job is not None and job.version >= version) or bool(
                self.store.get(policy_id, version))
        if await self.changed.wait_for(arrived, timeout=PULL_GRACE_S):
            return  # the gossiped manifest came first
        req = ShardRequest(policy_id=policy_id, version=version, shard=0)
        self.counters["manifest_pulls"] += 1
        try:
            data = await self.node.request(peer, MANIFEST_PROTOCOL, req.encode(),
                                           timeout=self.cfg.request_timeout_s)
            self.accept_bytes(data)
            return
        except ManifestRejected as e:
            if e.reason == "settings_mismatch":  # said once by the role; not asked again
                rec = self.records.get((policy_id, version))
                if rec is not None:
                    rec.refused = True
                return
            self._rejected(e, peer, policy_id, pulled=True)
            if e.reason in QUIET:
                return  # our state, not the peer's fault: ask again at its next advert
        except Exception as e:  # noqa: BLE001 - a peer that cannot answer; try the next advert
            log.debug("manifest pull from %s failed: %r", peer[-8:], e)
        self.counters["manifest_pulls_failed"] += 1
        if peer == policy_id:
            return  # the trainer itself is never backed off
        self._backoff[peer] = time.monotonic() + PULL_BACKOFF_S
        self._backoff.move_to_end(peer)
        while len(self._backoff) > MAX_BACKOFF_PEERS:
            self._backoff.popitem(last=False)

    async def choose(self) -> None:
        """Make the trainer choice (follow.py) and follow the trainer chosen."""
        if self.choice is not None:
            chosen = await ask_bootstrap_peers(self.choice, self.node,
                                               self.cfg.request_timeout_s)
            if chosen is not None:  # its versions come with its next adverts
                self.gate.follow_policy(chosen)
                self.changed.fire()

    # Views ---------------------------------------------------------------------------



def _download_counters(d: Downloader) -> Counter:
    out: Counter = Counter()
    for name, value in d.metrics.items():
        if name in DOWNLOAD_COUNTERS:
            out[DOWNLOAD_COUNTERS[name]] += value
        elif name.startswith("fail_"):
            out["fetch_failed_" + name[5:]] += value
    out["sources_dropped"] += d.book.dropped
    for reason, n in d.book.drops.items():
        out["sources_dropped_" + reason] += n
    return out
