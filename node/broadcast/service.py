"""The broadcaster of one node, over a `P2PNode`: publishes its own checkpoints (trainer),
follows its trainers' manifests, downloads and serves shards, advertises holdings.

Gossip: manifests on the `checkpoints` topic (the trainer's own signed envelope), holdings
on the `adverts` topic (ShardAdvert). Streams: shards on SHARD_PROTOCOL; the signed manifest
envelope of a version on MANIFEST_PROTOCOL (request/response), so a peer that missed the
gossip learns a version from anyone's advert. Roles: `trainer` publishes; `inference` and
`relay` follow (the relay mirrors and serves, keeping `relay_keep_versions`); every node
serves what it verified.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable
from pathlib import Path

from ...protocol.envelope import Envelope
from ...protocol.errors import ProtocolError
from ...protocol.ids import MANIFEST_PROTOCOL, SHARD_PROTOCOL
from ...protocol.messages import CheckpointManifest, ShardAdvert, ShardRequest, SwarmSettings
from ..diskspace import DiskFull, DiskWatch, ensure_free, is_disk_full
from .downloader import Downloader
from .errors import BroadcastError, DownloadFailed, ManifestRejected, StoreError
from .follow import TrainerChoice
from .manifest import AcceptedManifest, ManifestGate, build_manifest
from .progress import Progress
from .server import ShardServer
from .sources import SourceBook
from .store import ShardStore, VersionEntry, advert_shards
from .transport import P2PTransport, RoutingTransport

log = logging.getLogger(__name__)

CLOSE_TIMEOUT_S = 10.0
MAX_PROVEN = 4096  # peers remembered as having delivered verified shards
MAX_VERSIONS_TRACKED = 16  # versions per policy whose advertised sources are remembered
PULL_BACKOFF_S = 60.0
ADVERT_STEPS = 4  # partial holdings are advertised at each quarter of a version
OnComplete = Callable[[CheckpointManifest, Path], Awaitable[None] | None]


class Broadcaster:
    def __init__(self, node, cfg, store_root: Path, *, follow: list[str] | None = None,
                 role: str = "inference", on_complete: OnComplete | None = None,
                 transport=None, interactive: bool | None = None,
                 choice: TrainerChoice | None = None, settings: SwarmSettings | None = None,
                 settings_check: Callable[..., str | None] | None = None):
        self.node, self.cfg, self.role = node, cfg, role
        keep = cfg.relay_keep_versions if role == "relay" else cfg.keep_versions
        self.store = ShardStore(store_root, keep_versions=keep)
        self.choice = choice  # followers without --follow: the one explicit trainer choice
        if choice is not None and choice.chosen:
            follow = [*(follow or []), choice.chosen]
        self.settings = settings  # a trainer's: signed into each manifest it publishes
        self.gate = ManifestGate.from_config(follow or [], cfg, self.store.current_version,
                                             space_check=self._space_check,
                                             settings_check=settings_check)
        self.disk = DiskWatch("checkpoint downloads", self.store.root)
        self.proven: OrderedDict[str, None] = OrderedDict()  # peers we verified shards from
        self.server = ShardServer(self.store, cfg)
        self.transport = transport or RoutingTransport(P2PTransport(node))
        self.on_complete = on_complete
        self.interactive = interactive
        self.books: dict[tuple[str, int], SourceBook] = {}
        self.downloads: dict[str, tuple[int, asyncio.Task, Downloader]] = {}
        self._jobs: dict[str, tuple[int, asyncio.Task]] = {}  # per policy: version, task
        self.holders: dict[tuple[str, int], dict[str, set[int] | None]] = {}
        self.completed: dict[tuple[str, int], Path] = {}
        self.finished: dict[tuple[str, int], Downloader] = {}
        self.failures: dict[tuple[str, int], str] = {}
        self.source_hosts: dict[tuple[str, int], dict[str, str]] = {}
        self.unproven: dict[tuple[str, int], set[str]] = {}
        self.advert_metrics: Counter[str] = Counter()
        self._pull_backoff: dict[str, float] = {}
        self._refused: set[tuple[str, int]] = set()  # versions refused for their settings
        self._dirty: set[tuple[str, int]] = set()
        self._advertised: dict[tuple[str, int], int] = {}  # shards held at the last advert
        self._pulling: set[tuple[str, int]] = set()
        self._tasks: set[asyncio.Task] = set()
        self._wake = asyncio.Event()

    # Lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        for entry in await asyncio.to_thread(self.store.load, self.gate.problem):
            self._dirty.add(entry.key)
        # shard after shard on one stream while the client keeps sending requests
        self.node.set_stream_handler(SHARD_PROTOCOL, self.server.serve_connection)
        bulk = getattr(self.node, "bulk", None)
        if bulk is not None:  # the node's bulk plane (TLS beside libp2p) serves shards too
            bulk.register("shard", self.server.serve_connection)
            bulk.add_known(lambda peer: peer in self.proven or self.gate.follows(peer))
        self.node.set_request_handler(MANIFEST_PROTOCOL, self._serve_manifest)
        await self.node.subscribe("checkpoints", self._on_manifest)
        await self.node.subscribe("adverts", self._on_advert)
        self._spawn(self._advert_loop())
        # resume interrupted downloads of followed policies
        for entry in list(self.store.entries.values()):
            policy = entry.manifest.policy_id
            if (not entry.complete and self.gate.follows(policy)
                    and entry.manifest.version > self.store.current_version(policy)):
                self._start_download(AcceptedManifest(entry.manifest, entry.envelope,
                                                      entry.manifest.policy_id))

    @property
    def endpoint(self) -> str:
        """Our bulk-plane endpoint for adverts ("" if none to name: node/p2p/bulk)."""
        bulk = getattr(self.node, "bulk", None)
        return bulk.endpoint if bulk is not None else ""

    async def close(self) -> None:
        if isinstance(self.transport, RoutingTransport):
            self.transport.close()  # idle bulk-plane connections and pooled streams
        tasks = [*self._tasks, *(t for _, t in self._jobs.values())]
        for task in tasks:
            task.cancel()
        if tasks:
            _, stuck = await asyncio.wait(tasks, timeout=CLOSE_TIMEOUT_S)
            if stuck:
                log.warning("%d broadcast tasks did not stop within %.0fs", len(stuck),
                            CLOSE_TIMEOUT_S)

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # Trainer side ---------------------------------------------------------------------

    async def publish(self, ckpt_dir: Path, version: int, parent_version: int = -1,
                      shard_size: int | None = None,
                      hash_algo: str | None = None) -> CheckpointManifest:
        """Hash, store and announce a new checkpoint of this node's own policy
        (`hash_algo`, default `broadcast.hash_algo`: NODE_SPEC 7.1)."""
        m = await asyncio.to_thread(
            build_manifest, ckpt_dir, policy_id=self.node.peer_id, version=version,
            parent_version=parent_version, shard_size=shard_size or self.cfg.shard_size,
            settings=self.settings, hash_algo=hash_algo or self.cfg.hash_algo)
        accepted = AcceptedManifest(m, self.node.identity.seal(m), self.node.peer_id)
        entry = await asyncio.to_thread(self.store.add_checkpoint, accepted, ckpt_dir)
        await asyncio.to_thread(self.store.prune, m.policy_id)
        self.completed[entry.key] = entry.checkpoint_dir
        await self._advertise(entry)  # first, so followers know our TCP endpoint, if any
        await self.node.publish("checkpoints", m)
        log.info("published policy %s v%d: %d bytes in %d shards", m.policy_id[-8:], version,
                 m.total_size, m.num_shards)
        return m

    # Follower side --------------------------------------------------------------------

    async def _on_manifest(self, env: Envelope, from_peer: str) -> None:
        policy = getattr(env.message, "policy_id", None)
        if policy == env.sender:
            self._offer_choice(env.sender, policy)
        try:
            accepted = self.gate.check_envelope(env)
        except ManifestRejected as e:
            quiet = e.reason in ("settings_mismatch", "not_newer")  # said once elsewhere
            log.log(logging.DEBUG if quiet else logging.WARNING, "%s (from %s)", e,
                    from_peer[-8:])
            return
        self._remember(accepted.manifest.policy_id, accepted.manifest.version, env.sender,
                       None)
        self._start_download(accepted)

    def accept_bytes(self, data: bytes) -> AcceptedManifest:
        """Check a sealed manifest from elsewhere (a file, a manifest request) and start
        downloading it. Raises ManifestRejected."""
        accepted = self.gate.check_bytes(data)
        self._start_download(accepted)
        return accepted

    def _space_check(self, m: CheckpointManifest) -> None:
        """Gate check: the version must fit the free disk now (with the margin); raises
        DiskFull, so the manifest is refused before any byte is written."""
        entry = self.store.get(m.policy_id, m.version)
        have = sum(entry.shard_len(i) for i in entry.have) if entry is not None else 0
        try:
            ensure_free(self.store.root, m.total_size - have)
        except DiskFull as e:
            self.disk.hit(e)
            raise

    def _start_download(self, accepted: AcceptedManifest) -> None:
        m = accepted.manifest
        current = self._jobs.get(m.policy_id)
        if current is not None:
            if current[0] >= m.version:
                return
            current[1].cancel()  # a newer version supersedes an unfinished one
        if self.store.current_version(m.policy_id) >= m.version:
            return
        self._jobs[m.policy_id] = (m.version, asyncio.create_task(self._download(accepted)))

    def _downloader(self, accepted: AcceptedManifest, entry: VersionEntry) -> Downloader:
        m, key = accepted.manifest, entry.key
        book = self.books.setdefault(key, SourceBook(
            per_source=self.cfg.per_source_downloads, max_corrupt=self.cfg.max_corrupt_per_source))
        book.add(m.policy_id, None, origin=True)  # the trainer holds its own checkpoint
        for peer, holdings in self.holders.get(key, {}).items():
            book.add(peer, holdings)
        progress = Progress(f"policy {m.policy_id[-8:]} v{m.version}", m.total_size,
                            interactive=self.interactive)
        return Downloader(self.store, entry, self.transport, book, self.cfg,
                          on_shard=lambda i, k=key: self._shard_verified(k), progress=progress,
                          disk=self.disk, on_verified=self._prove)

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

    async def _download(self, accepted: AcceptedManifest) -> None:
        m = accepted.manifest
        try:
            entry = await self._open_entry(accepted)
            d = self._downloader(accepted, entry)
            self.downloads[m.policy_id] = (m.version, asyncio.current_task(), d)
            path = await d.run()
        except (DownloadFailed, StoreError) as e:
            self.failures[(m.policy_id, m.version)] = e.reason
            log.error("policy %s v%d failed: %s", m.policy_id[-8:], m.version, e)
            return
        finally:
            if self._jobs.get(m.policy_id, (None, None))[1] is asyncio.current_task():
                del self._jobs[m.policy_id]
                self.downloads.pop(m.policy_id, None)
        self.finished[entry.key] = d
        await asyncio.to_thread(self.store.prune, m.policy_id)
        if self.on_complete is not None:  # hand it over first: `completed` means handed over
            try:
                result = self.on_complete(m, path)
                if asyncio.iscoroutine(result):
                    await result
            except Exception:  # the consumer's fault; the version stays served
                log.exception("on_complete for policy %s v%d failed", m.policy_id[-8:],
                              m.version)
        self.completed[entry.key] = path
        self._mark_dirty(entry.key)

    async def wait_complete(self, policy_id: str, version: int, timeout: float) -> Path:
        """For tests and the CLI: wait until (policy, version) is complete here."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while (policy_id, version) not in self.completed:
            if (policy_id, version) in self.failures:
                raise DownloadFailed(f"v{version}: {self.failures[(policy_id, version)]}")
            if loop.time() > deadline:
                raise TimeoutError(f"policy {policy_id} v{version} not complete in {timeout}s")
            await asyncio.sleep(0.05)
        return self.completed[(policy_id, version)]

    # Adverts --------------------------------------------------------------------------

    def _remember(self, policy_id: str, version: int, peer: str,
                  holdings: set[int] | None) -> None:
        key = (policy_id, version)
        known = self.holders.setdefault(key, {})
        if peer in known and known[peer] is not None and holdings is not None:
            known[peer] |= holdings
        else:
            known[peer] = None if holdings is None else set(holdings)
        book = self.books.get(key)
        current = self.downloads.get(policy_id)
        if book is not None:
            book.add(peer, holdings)
            if current is not None and current[0] == version:
                current[2].sources_changed()

    async def _on_advert(self, env: Envelope, from_peer: str) -> None:
        ad: ShardAdvert = env.message
        self._offer_choice(env.sender, ad.policy_id)
        if not self.gate.follows(ad.policy_id):
            return
        key = (ad.policy_id, ad.version)
        if not self._admit(key, env.sender, ad.endpoint):
            self.advert_metrics["adverts_not_admitted"] += 1
            return
        if ad.endpoint and hasattr(self.transport, "set_endpoint"):
            self.transport.set_endpoint(env.sender, ad.endpoint)
        entry = self.store.get(ad.policy_id, ad.version)
        if entry is None:
            if (ad.version > self.store.current_version(ad.policy_id)
                    and ad.policy_id not in self._jobs and self._may_pull(env.sender, key)):
                self._pulling.add(key)
                self._spawn(self._pull_manifest(env.sender, ad.policy_id, ad.version))
            n = None
        else:
            n = entry.manifest.num_shards
        holdings = None if ad.complete else advert_shards(ad, n if n is not None else
                                                          len(ad.have) * 8)
        self._remember(ad.policy_id, ad.version, env.sender, holdings)

    # Who may be a source (advert poisoning) --------------------------------------------

    def _offer_choice(self, announcer: str, policy_id: str) -> None:
        if self.choice is not None and self.choice.offer(announcer, policy_id):
            self.gate.follow_policy(policy_id)

    def _prove(self, peer: str) -> None:
        self.proven[peer] = None
        self.proven.move_to_end(peer)
        while len(self.proven) > MAX_PROVEN:
            self.proven.popitem(last=False)

    def _admit(self, key: tuple[str, int], peer: str, endpoint: str) -> bool:
        """Whether `peer`'s advert for `key` makes it a candidate source. The trainer and
        peers we verified shards from always; others ("unproven") only up to
        `max_unproven_sources` per version, ever, and at most `max_sources_per_host` of
        them per TCP endpoint host; candidates are tracked for at most
        MAX_VERSIONS_TRACKED versions per policy (sybil keys cost nothing, so none of this
        grows with them). An unproven peer becomes proven with its first verified shard."""
        known = self.holders.get(key)
        if known is not None and peer in known:
            return True
        if known is None:
            self._track_version(key)
            known = self.holders.setdefault(key, {})
        hosts = self.source_hosts.setdefault(key, {})
        host = endpoint.rpartition(":")[0] if endpoint else ""
        if peer != key[0] and peer not in self.proven:
            unproven = self.unproven.setdefault(key, set())
            same_host = sum(1 for p, h in hosts.items() if h == host and p in unproven)
            if (len(unproven) >= self.cfg.max_unproven_sources
                    or (host and same_host >= self.cfg.max_sources_per_host)):
                return False
            unproven.add(peer)
        hosts[peer] = host
        return True

    def _track_version(self, key: tuple[str, int]) -> None:
        mine = [k for k in self.holders if k[0] == key[0]]
        for old in sorted(mine, key=lambda k: k[1])[:max(0, len(mine) - MAX_VERSIONS_TRACKED + 1)]:
            if self._jobs.get(old[0], (None,))[0] == old[1]:
                continue
            for d in (self.holders, self.source_hosts, self.unproven):
                d.pop(old, None)

    def _may_pull(self, peer: str, key: tuple[str, int]) -> bool:
        """One manifest pull in flight per policy; an advertiser whose pull failed is not
        asked again for PULL_BACKOFF_S (fake versions cost the attacker, not us); a version
        refused for its settings is not asked for again."""
        if key in self._refused or any(k[0] == key[0] for k in self._pulling):
            return False
        until = self._pull_backoff.get(peer, 0.0)
        return until <= asyncio.get_running_loop().time()

    async def _pull_manifest(self, peer: str, policy_id: str, version: int) -> None:
        req = ShardRequest(policy_id=policy_id, version=version, shard=0)
        try:
            await self._fetch_manifest(peer, req)
        finally:
            self._pulling.discard((policy_id, version))

    async def _fetch_manifest(self, peer: str, req: ShardRequest) -> None:
        try:
            data = await self.node.request(peer, MANIFEST_PROTOCOL, req.encode(),
                                           timeout=self.cfg.request_timeout_s)
            self.accept_bytes(data)
            return
        except ManifestRejected as e:
            if e.reason == "settings_mismatch":  # said once by the role; not asked again
                self._refused.add((req.policy_id, req.version))
                return
            log.info("manifest from %s: %s", peer[-8:], e)
            if e.reason in ("no_space", "not_newer"):
                return  # our state, not the peer's fault: ask again at its next advert
        except Exception as e:  # noqa: BLE001 - a peer that cannot answer; try the next advert
            log.debug("manifest pull from %s failed: %r", peer[-8:], e)
        if peer == req.policy_id:
            return  # the trainer itself is never backed off
        self._pull_backoff[peer] = asyncio.get_running_loop().time() + PULL_BACKOFF_S
        while len(self._pull_backoff) > MAX_PROVEN:
            self._pull_backoff.pop(next(iter(self._pull_backoff)))

    async def _serve_manifest(self, peer: str, body: bytes) -> bytes:
        try:
            req = ShardRequest.decode(body)
        except ProtocolError as e:
            raise BroadcastError(f"bad manifest request: {e.reason}") from None
        entry = self.store.get(req.policy_id, req.version)
        if entry is None:
            raise LookupError("version not held here")
        return entry.envelope

    def _shard_verified(self, key: tuple[str, int]) -> None:
        """Advertise partial holdings in ADVERT_STEPS steps per version, not per shard:
        each advert costs every peer gossip CPU (profiled: py-libp2p's per-message cost
        was most of a client's CPU on the data plane; 8 clients, quarters instead of
        eighths: gossip copies received per client 236 -> 134, libp2p CPU 0.56 -> 0.47 s,
        peers still served half the bytes), and a step of the version is what makes a peer
        worth asking. Completion is always advertised."""
        entry = self.store.get(*key)
        if entry is None:
            return
        step = max(1, entry.manifest.num_shards // ADVERT_STEPS)
        if len(entry.have) - self._advertised.get(key, 0) >= step:
            self._advertised[key] = len(entry.have)
            while len(self._advertised) > MAX_VERSIONS_TRACKED:
                self._advertised.pop(next(iter(self._advertised)))
            self._mark_dirty(key)

    def _mark_dirty(self, key: tuple[str, int]) -> None:
        self._dirty.add(key)
        self._wake.set()

    async def _advertise(self, entry: VersionEntry) -> None:
        advert = entry.advert()
        if self.endpoint:
            advert = advert.model_copy(update={"endpoint": self.endpoint})
        try:
            await self.node.publish("adverts", advert)
        except Exception as e:  # noqa: BLE001 - gossip congestion: the next round retries
            log.debug("advert failed: %r", e)
            self._dirty.add(entry.key)

    async def _advert_loop(self) -> None:
        loop = asyncio.get_running_loop()
        last_all = loop.time()
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), self.cfg.readvertise_s)
            except TimeoutError:
                pass
            self._wake.clear()
            if loop.time() - last_all >= self.cfg.readvertise_s:
                last_all = loop.time()
                self._dirty |= set(self.store.entries)
            dirty, self._dirty = self._dirty, set()
            for key in dirty:
                entry = self.store.get(*key)
                if entry is not None and (entry.complete or entry.have):
                    await self._advertise(entry)
            await asyncio.sleep(self.cfg.advert_interval_s)
