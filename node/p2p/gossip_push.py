"""Announced gossip bodies pushed by their publisher (NODE_SPEC 3, "Pushed bodies").

A pull costs the announce's trip, then a request round trip before the first byte: over a
200 ms path that is ~1.5 RTT before the body moves (RESULTS "wan: gossip"). So a publisher
also writes each body it announces, at once, down one long-lived bulk-plane link (kind
"push2") to each directly connected peer it has one with: the body arrives half a round
trip plus its transfer after the publish, often before its announce. Pulls stay the
fallback (a peer with no link, a push that failed or did not come).

A link carries bodies one way only (a BulkConn is never read and written at once: a large
write runs in a thread). The side that dials says which way with its first byte after the
hello: SEND (the dialler pushes to the server) or RECEIVE (the server pushes to the
dialler). A node dials SEND links to the peers whose bulk plane it can use; a node that is
not publicly reachable also dials RECEIVE links to them, so a public publisher reaches it
too. Frames: u8 type + 32-byte SHA-256 + u32 BE length (+ for type 2, forward: the peers
to push it on to; + for type 3, forward-all: those, the public peers the body went to, and
the subscribers the publisher reaches or named) + the body. Two nodes behind NAT have no
link: the publisher names such a subscriber to FORWARD_COPIES (2) public peers it pushes
to, which forward the body once they checked the announce (so forwards stay within the
origin's admitted rate; two: one of them may hold no connection to it), or at once when
the publisher pushed them its own body and it opens (`_forward_early`: the body proves
its origin; within a per-origin budget at the topic's rate). A subscriber the
publisher is not connected to at all (both behind NAT, no relayed connection) it cannot
name: a forward-all frame lets each of its public peers push the body on to its own
subscribers outside the publisher's lists, each to the two the rendezvous hash picks. In the 12-node simulated WAN such subscribers pulled 40-356
bodies a run, each ~1-2 s into its round: most rounds ended with one (RESULTS "wan:
gossip"). A forwarder's upload per body: at most MAX_FORWARD copies, within the origin's
admitted rate; a receiver's second copy is dropped as a duplicate.

What a receiver does with a pushed body: the length is bounded by the largest payload it
accepts (more: `too_large`, charged to the pusher, link closed); the hash must match
(`hash_mismatch`, the same); the body is then held, unclaimed, until a signed announce of
that hash arrives (pubsub.py opens it as if pulled: a bad body is the origin's fault, the
pusher only carried bytes the origin signed). Unclaimed bodies are bounded per pusher
(UNCLAIMED_PER_PEER bodies and UNCLAIMED_BYTES_PER_PEER bytes, its oldest dropped, counted
`payload_push_unclaimed_dropped`) and in all (UNCLAIMED_MAX, UNCLAIMED_BYTES_MAX); past
the bound in all, the oldest body of the pusher holding the most bytes goes, so N fresh
identities pushing junk evict each other, not an honest pusher's one body waiting for its
announce; a body held already is counted `payload_push_duplicate` and dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import struct
import time
from collections import OrderedDict
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from .bulk import BulkBusy, BulkClient, BulkConn, BulkError, BulkUnavailable
from .metrics import P2PMetrics

log = logging.getLogger(__name__)

KIND = "push2"  # "push" before the forward-all frame (type 3): an older node answers
# NO_HANDLER to a push2 hello, so mixed versions pull, and none charges the other for type 3
SEND, RECEIVE = b"S", b"R"  # the dialler's first byte: which way the link carries bodies
FRAME_BODY, FRAME_FORWARD, FRAME_FORWARD_ALL = 1, 2, 3
_FRAME = struct.Struct(">B32sI")
MAX_FORWARD = 64  # peers one forward frame may name
# Public peers a subscriber the publisher does not push to is named to (or, unnamed, given
# to by the rendezvous hash): the first one the hash picks may hold no connection to it.
# In the 12-node simulated WAN a peer behind a symmetric NAT held connections to 5 of the 6
# public peers; with one forwarder each, every body forwarded by the sixth was pulled.
FORWARD_COPIES = 2
# Pushed bodies held before their announce: per pusher and in all (oldest dropped first).
UNCLAIMED_PER_PEER = 32
UNCLAIMED_MAX = 1024
# ... and in bytes: a body may be as large as the largest envelope (16 MiB), so the counts
# alone let one pusher park 512 MiB and N of them 16 GiB (two 16-MiB batches per pusher)
UNCLAIMED_BYTES_PER_PEER = 32 << 20
UNCLAIMED_BYTES_MAX = 256 << 20
UNCLAIMED_TTL_S = 60.0
# Bodies being read: a link reads PUSH_READ_CHUNK at a time into a buffer that holds what
# has arrived, not what its frame claims (`readexactly(size)` asked the socket for up to the
# whole 16 MiB at once, per link), and what all links hold so far is bounded: past
# READING_BYTES_MAX the link reading the most is ended (counted, not charged: it may be an
# honest pusher's; the body is then pulled). So N links cost at most that, not N x 16 MiB.
PUSH_READ_CHUNK = 256 << 10
READING_BYTES_MAX = 64 << 20
# An announce waits this long for its body's push (from the announcer, or forwarded) to
# start before pulling; a push started is waited for until it ends or fails. In the 12-node
# simulated WAN the pushes that came started within 0.16 s (p95) of their announce, on a
# machine at load 10-18.
PUSH_WAIT_S = 0.3


@dataclass(eq=False)
class _Link:
    peer: str
    conn: BulkConn
    sends: bool  # True: we write bodies on it; False: we read them
    dialled: bool = False  # we dialled it: the peer's plane is reachable (it is public)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    closed: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass(eq=False)
class _Unclaimed:
    pusher: str
    data: bytes
    at: float
    forward: tuple[str, ...] = ()  # peers the pusher asked us to push it on to
    # forward-all frame: the origin's forwarders (rendezvous over them), and the peers it
    # reaches itself or named to one of them; None: a plain frame, no more than `forward`
    extra: tuple[tuple[str, ...], frozenset[str]] | None = None


class BodyPusher:
    """The push links of one node. `max_size()`: the largest body accepted; `held(hash)`:
    whether the node holds that body already; `charge(peer, reason)`: count and penalise
    a pusher's offence; `spawn(coro, name)`: the node's task owner; `member(peer)`: whether
    `peer` is a connected member of this swarm now (links go to members only: opening one
    asks the peer over libp2p, which would dial a peer that just left or refused us)."""

    def __init__(self, client: BulkClient, cfg, metrics: P2PMetrics, *,
                 max_size: Callable[[], int], held: Callable[[bytes], bool],
                 charge: Callable[[str, str], None], spawn: Callable[..., object],
                 reachable: Callable[[], bool], member: Callable[[str], bool],
                 me: str = "", early: Callable[[str, bytes], Collection[str] | None] | None = None):
        self.client, self.cfg, self.metrics, self.me = client, cfg, metrics, me
        self.early = early
        self.max_size, self.held, self.charge, self.spawn = max_size, held, charge, spawn
        self.reachable, self.member = reachable, member
        self.out: dict[str, _Link] = {}  # links we push on, by peer
        self.inn: dict[str, list[_Link]] = {}  # links we read from, by peer
        self.unclaimed: OrderedDict[bytes, _Unclaimed] = OrderedDict()
        self._per_peer: dict[str, int] = {}
        self._bytes: dict[str, int] = {}  # unclaimed bytes by pusher
        self.unclaimed_bytes = 0
        self._arrived: dict[bytes, asyncio.Event] = {}  # a push of that hash started/ended
        self._incoming: dict[bytes, asyncio.Future] = {}  # a push being read
        self._reading: dict[_Link, int] = {}  # body bytes read so far, by link reading one
        self.reading_bytes = 0
        self._opening: set[str] = set()
        self._closed = False  # close(): no link is opened or accepted after it
        # claimed: to whom (the names, and a forward-all frame's extra: `_Unclaimed`)
        self._forward: OrderedDict[bytes, tuple] = OrderedDict()

    # Links ---------------------------------------------------------------------------

    def pushes_to_us(self, peer: str) -> bool:
        """Whether `peer` has a link to push bodies to us."""
        return bool(self.inn.get(peer))

    def push_wait(self, origin: str) -> float:
        """How long an announce of `origin` waits for a push to start before pulling: from
        the announcer, or (no link with it) forwarded by a peer with a link to us. An
        origin we are not connected to included: its public peers push its body on to
        their subscribers it neither reaches nor named (forward-all frame)."""
        return PUSH_WAIT_S if self.pushes_to_us(origin) or self.inn else 0.0

    async def connect(self, peer: str) -> None:
        """On a new libp2p connection: our SEND link to `peer`, and a RECEIVE link too
        while we are not publicly reachable (it cannot dial ours). Failures leave the
        pulls to do the work (the plane's client marks the peer down)."""
        if (self._closed or peer in self._opening or not self.client.usable(peer, KIND)
                or not self.member(peer)):
            return
        self._opening.add(peer)
        try:
            if peer not in self.out:
                await self._dial(peer, SEND)
            if not self.reachable() and not self.inn.get(peer) and self.member(peer):
                await self._dial(peer, RECEIVE)
        finally:
            self._opening.discard(peer)

    async def _dial(self, peer: str, way: bytes) -> None:
        try:
            conn = await self.client.open(peer, KIND, fresh=True, mark_down=False)
            async with asyncio.timeout(self.client.cfg.handshake_timeout_s):
                await conn.write(way)
        except (BulkUnavailable, BulkBusy, BulkError, TimeoutError, OSError) as e:
            self.metrics.inc("payload_push_link_failed")
            log.debug("no push link to %s: %s", peer[-8:], e)
            return
        if self._closed:  # closed while this dial was under way
            conn.abort()
            return
        link = _Link(peer, conn, sends=way == SEND, dialled=True)
        self.metrics.inc("payload_push_links")
        if link.sends:
            self._add_out(link)
        else:
            self.spawn(self._read_link(link), "push link reader")

    def _add_out(self, link: _Link) -> None:
        old = self.out.get(link.peer)
        if old is not None and not old.closed.is_set():
            link.conn.abort()  # one link per peer to push on: the first stays
            return
        self.out[link.peer] = link

    async def serve(self, peer: str, conn: BulkConn) -> None:
        """Bulk-plane handler of kind "push2": the dialler's first byte says which way."""
        if self._closed:
            return  # the handler's return closes the connection
        try:
            async with asyncio.timeout(self.client.cfg.handshake_timeout_s):  # lifecycle.wait_set
                way = await conn.readexactly(1)
        except (TimeoutError, asyncio.IncompleteReadError, BulkError):
            return
        if self._closed:
            return
        if way == SEND:
            await self._read_link(_Link(peer, conn, sends=False))
        elif way == RECEIVE:
            link = _Link(peer, conn, sends=True)
            self._add_out(link)
            if self.out.get(peer) is link:
                await link.closed.wait()  # the handler's return closes the connection
        else:
            self.charge(peer, "malformed")

    def _drop(self, link: _Link) -> None:
        link.closed.set()
        link.conn.abort()
        if self.out.get(link.peer) is link:
            del self.out[link.peer]
        links = self.inn.get(link.peer)
        if links and link in links:
            links.remove(link)
            if not links:
                del self.inn[link.peer]

    # Sending -------------------------------------------------------------------------

    def push(self, digest: bytes, data: bytes, fanout: int, to: set[str],
             via: int = 0) -> int:
        """Push a body we announce to up to `fanout` of the peers `to` (its topic's
        subscribers) we have a link with; how many. Each subscriber we have no link with
        (both of us behind NAT) is named to FORWARD_COPIES public peers we push to
        (rendezvous hash of body and subscriber), which forward it once they checked the
        announce, if they have a link with that subscriber; else the subscriber pulls.

        `via` > 0 while we are not publicly reachable (a home uplink): the body goes to at
        most `via` public peers only (rendezvous hash of the body: spread over them), and
        every other subscriber is named to them to forward. Each public peer the
        body goes to gets a forward-all frame (see `forward`), while the lists fit in
        MAX_FORWARD. Writing it to every
        subscriber at once queued all the copies (and the announce behind them) in the
        slow uplink: 8 copies of 64 KiB take 0.42 s at 10 Mbit/s, one 52 ms."""
        links = [link for link in list(self.out.values())
                 if link.peer in to and not link.closed.is_set()]
        public_links = [link for link in links if link.dialled]
        if via > 0 and public_links and not self.reachable():
            links = sorted(public_links, key=lambda link: hashlib.sha256(
                digest + link.peer.encode()).digest())[:via]
            self.metrics.inc("payload_push_via_public")
        else:
            links = links[:fanout]
        for peer in to.difference(self.out).difference(self._opening):
            self.spawn(self.connect(peer), "push link")  # lost (evicted, broken): again
        public = [link.peer for link in links if link.dialled]
        forward: dict[str, list[str]] = {}
        for peer in sorted(to.difference(link.peer for link in links))[:MAX_FORWARD]:
            for by in _rendezvous(digest, peer, public):
                forward.setdefault(by, []).append(peer)
        # the subscribers we reach ourselves or name: a public peer pushes the body on to
        # its own subscribers outside this set (we know nothing of them: no connection)
        covered = sorted(to.difference(public))
        everyone = public and len(public) <= MAX_FORWARD and len(covered) <= MAX_FORWARD
        for link in links:
            names = forward.get(link.peer, [])
            if everyone and link.dialled:
                head = (_FRAME.pack(FRAME_FORWARD_ALL, digest, len(data)) + _names(names)
                        + _names(public) + _names(covered))
            elif names:
                head = _FRAME.pack(FRAME_FORWARD, digest, len(data)) + _names(names)
            else:
                head = _FRAME.pack(FRAME_BODY, digest, len(data))
            self.spawn(self._send(link, head + data), "push body")
        return len(links)

    def forward(self, digest: bytes, data: bytes, origin: str,
                subscribers: Collection[str] = ()) -> int:
        """After a pushed body was claimed and opened (or opened before its announce:
        `_forward_early`): push it on to the peers its pusher named (forward frame) that
        we have a link with; how many. A forward-all frame
        adds our `subscribers` (the topic's) that its origin neither reaches nor named,
        those whose rendezvous hash over the origin's forwarders picks us (one of
        FORWARD_COPIES); MAX_FORWARD copies in all at most."""
        names, extra = self._forward.pop(digest, ((), None))
        targets = list(dict.fromkeys(names))
        if extra is not None and self.me:
            vias, covered = extra
            if self.me in vias:
                skip = covered.union(vias, names, (origin,))
                targets += [p for p in sorted(subscribers) if p not in skip
                            and self.me in _rendezvous(digest, p, vias)]
        frame = _FRAME.pack(FRAME_BODY, digest, len(data)) + data
        n = 0
        for peer in targets:
            link = self.out.get(peer)
            if link is not None and peer != origin and not link.closed.is_set():
                self.spawn(self._send(link, frame), "forward body")
                n += 1
                if peer not in names:
                    self.metrics.inc("payload_push_forwarded_unnamed")
                if n >= MAX_FORWARD:
                    break
        self.metrics.inc("payload_push_forwarded", n)
        return n

    async def _send(self, link: _Link, frame: bytes) -> None:
        try:
            async with link.lock, asyncio.timeout(self.cfg.payload_pull_timeout_s):
                await link.conn.write(frame)
        except (BulkError, TimeoutError, OSError) as e:
            self.metrics.inc("payload_push_failed")
            log.debug("push to %s failed: %s", link.peer[-8:], e)
            self._drop(link)
            return
        self.metrics.inc("payload_pushed")

    # Receiving -----------------------------------------------------------------------

    async def _read_link(self, link: _Link) -> None:
        self.inn.setdefault(link.peer, []).append(link)
        try:
            while True:
                try:
                    head = await link.conn.readexactly(_FRAME.size)
                except (asyncio.IncompleteReadError, BulkError):
                    return
                kind, digest, size = _FRAME.unpack(head)
                names: tuple[str, ...] = ()
                extra = None
                if kind in (FRAME_FORWARD, FRAME_FORWARD_ALL):
                    names = await self._read_names(link)
                    if names is None:
                        return
                if kind == FRAME_FORWARD_ALL:
                    vias = await self._read_names(link)
                    covered = None if vias is None else await self._read_names(link)
                    if covered is None:
                        return
                    extra = (vias, frozenset(covered))
                if kind in (FRAME_FORWARD, FRAME_FORWARD_ALL):
                    kind = FRAME_BODY
                if not await self._read_body(link, kind, digest, size, names, extra):
                    return
        finally:
            self._drop(link)

    async def _read_names(self, link: _Link) -> tuple[str, ...] | None:
        """The peers a forward frame names (None: malformed, charged, the link ends)."""
        try:
            async with asyncio.timeout(self.client.cfg.handshake_timeout_s):
                n = (await link.conn.readexactly(1))[0]
                if n > MAX_FORWARD:
                    self.charge(link.peer, "malformed")
                    return None
                names = []
                for _ in range(n):
                    k = (await link.conn.readexactly(1))[0]
                    names.append((await link.conn.readexactly(k)).decode("ascii"))
        except (TimeoutError, asyncio.IncompleteReadError, BulkError):
            return None
        except UnicodeDecodeError:
            names = None
        if names is None:
            self.charge(link.peer, "malformed")
            return None
        return tuple(names)

    async def _read_body(self, link: _Link, kind: int, digest: bytes, size: int,
                         names: tuple[str, ...] = (), extra=None) -> bool:
        """One pushed body; False ends the link (a fault of the pusher, or a break)."""
        if kind != FRAME_BODY:
            self.charge(link.peer, "malformed")
            return False
        if size > self.max_size():
            self.charge(link.peer, "too_large")
            return False
        fut = None
        if (digest not in self._incoming and digest not in self.unclaimed
                and not self.held(digest)):
            fut = self._incoming[digest] = asyncio.get_running_loop().create_future()
            self._wake(digest)
        data, got = None, b""
        try:
            async with asyncio.timeout(self.cfg.payload_pull_timeout_s):
                data, got = await self._stream(link, size)
        except (TimeoutError, asyncio.IncompleteReadError, BulkError):
            self.metrics.inc("payload_push_broken")
            return False
        finally:
            ok = data is not None and got == digest
            if fut is not None:
                del self._incoming[digest]
                if ok and digest not in self.unclaimed:
                    self._hold(link.peer, digest, data, names, extra)
                    fut.set_result(data)
                else:
                    fut.set_result(None)
        if not ok:
            self.charge(link.peer, "hash_mismatch")
            return False
        self.metrics.inc("payload_push_received")
        if fut is None:  # held already, or another link was bringing it
            self.metrics.inc("payload_push_duplicate")
        elif names or extra is not None:
            self._forward_early(link.peer, digest)
        return True

    def _forward_early(self, pusher: str, digest: bytes) -> None:
        """A body its origin pushed to us itself, naming peers to forward it to: pushed on
        at once if `early` opens it (signed by the pusher, sizes, type known, timestamp
        within the skew) within the origin's rate, not once its announce reached us
        through the mesh (0.3-0.5 s later in the 12-node WAN lab: RESULTS "wan: gossip").
        The same copies as after the announce's check (`forward`); the body stays held for
        its announce, which opens it again (replay cache, the origin's admitted rate)."""
        entry = self.unclaimed.get(digest)
        if self.early is None or entry is None or entry.pusher != pusher:
            return
        subscribers = self.early(pusher, entry.data)
        if subscribers is None:
            return
        self._forward[digest] = (entry.forward, entry.extra)
        entry.forward, entry.extra = (), None  # claimed later: forwarded already
        n = self.forward(digest, entry.data, pusher, subscribers)
        self.metrics.inc("payload_push_forwarded_early", n)

    async def _stream(self, link: _Link, size: int) -> tuple[bytes, bytes]:
        """(body, its SHA-256): `size` bytes read PUSH_READ_CHUNK at a time, counted in
        `reading_bytes` while read (READING_BYTES_MAX)."""
        buf, h = bytearray(), hashlib.sha256()
        self._reading[link] = 0
        try:
            while len(buf) < size:
                part = await link.conn.read(min(PUSH_READ_CHUNK, size - len(buf)))
                if not part:
                    raise asyncio.IncompleteReadError(bytes(buf), size)
                if link not in self._reading:  # ended for the bound meanwhile
                    raise BulkError("push read ended (bodies being read)", reason="broken")
                buf += part
                h.update(part)
                self._reading[link] += len(part)
                self.reading_bytes += len(part)
                self._bound_reading()
                if link not in self._reading:  # this link was the one ended
                    raise BulkError("push read ended (bodies being read)", reason="broken")
            return bytes(buf), h.digest()
        finally:
            self.reading_bytes -= self._reading.pop(link, 0)

    def _bound_reading(self) -> None:
        """Past READING_BYTES_MAX read in all, end the link that has read the most."""
        while self.reading_bytes > READING_BYTES_MAX and self._reading:
            victim = max(self._reading, key=self._reading.__getitem__)
            self.reading_bytes -= self._reading.pop(victim)
            self.metrics.inc("payload_push_read_dropped")
            log.debug("push link of %s ended: %d body bytes being read in all",
                      victim.peer[-8:], self.reading_bytes)
            self._drop(victim)

    def _wake(self, digest: bytes) -> None:
        event = self._arrived.pop(digest, None)
        if event is not None:
            event.set()

    def _hold(self, pusher: str, digest: bytes, data: bytes,
              names: tuple[str, ...] = (), extra=None) -> None:
        now = time.monotonic()
        while self._per_peer.get(pusher, 0) and (
                self._per_peer[pusher] >= UNCLAIMED_PER_PEER
                or self._bytes[pusher] + len(data) > UNCLAIMED_BYTES_PER_PEER):
            self._evict(pusher)
        self.unclaimed[digest] = _Unclaimed(pusher, data, now, names, extra)
        self._per_peer[pusher] = self._per_peer.get(pusher, 0) + 1
        self._bytes[pusher] = self._bytes.get(pusher, 0) + len(data)
        self.unclaimed_bytes += len(data)
        while self.unclaimed and next(iter(self.unclaimed.values())).at < now - UNCLAIMED_TTL_S:
            self._forget(next(iter(self.unclaimed)))
            self.metrics.inc("payload_push_unclaimed_dropped")
        while (len(self.unclaimed) > UNCLAIMED_MAX
               or self.unclaimed_bytes > UNCLAIMED_BYTES_MAX):
            self._evict(max(self._bytes, key=self._bytes.__getitem__))  # the largest holder

    def _evict(self, pusher: str) -> None:
        """Drop `pusher`'s oldest unclaimed body (counted)."""
        self._forget(next(d for d, u in self.unclaimed.items() if u.pusher == pusher))
        self.metrics.inc("payload_push_unclaimed_dropped")

    def _forget(self, digest: bytes) -> _Unclaimed | None:
        entry = self.unclaimed.pop(digest, None)
        if entry is not None:
            left = self._per_peer[entry.pusher] - 1
            self.unclaimed_bytes -= len(entry.data)
            if left:
                self._per_peer[entry.pusher] = left
                self._bytes[entry.pusher] -= len(entry.data)
            else:
                del self._per_peer[entry.pusher], self._bytes[entry.pusher]
        return entry

    def claim(self, digest: bytes, size: int) -> bytes | None:
        """The pushed body of that hash and size, handed over once (None: none held)."""
        entry = self.unclaimed.get(digest)
        if entry is None or len(entry.data) != size:
            return None
        self._forget(digest)
        self.metrics.inc("payload_push_claimed")
        if entry.forward or entry.extra:  # pushed on by `forward` once the caller opened it
            self._forward[digest] = (entry.forward, entry.extra)
            while len(self._forward) > UNCLAIMED_MAX:
                self._forward.popitem(last=False)
        return entry.data

    def pulled(self, digest: bytes) -> None:
        """The body was pulled: a push of it held meanwhile is a duplicate."""
        if self._forget(digest) is not None:
            self.metrics.inc("payload_push_duplicate")

    async def wait(self, digest: bytes, size: int, wait_s: float) -> bytes | None:
        """The pushed body of an announce: held already, or being read (waited for), or
        one that starts within `wait_s` (push_wait). None: pull it."""
        data = self.claim(digest, size)
        if data is not None:
            return data
        if digest not in self._incoming and wait_s > 0:
            event = self._arrived.setdefault(digest, asyncio.Event())
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait_s):
                    await event.wait()
            if self._arrived.get(digest) is event:
                del self._arrived[digest]
        fut = self._incoming.get(digest)
        if fut is not None:
            await asyncio.shield(fut)  # the reader resolves it however the read ends
        return self.claim(digest, size)

    async def landed(self, digest: bytes, size: int) -> bytes:
        """The pushed body of that hash and size once a push of it lands (held already,
        or read to its end from now on), claimed: for a pull under way, which it may
        overtake (pubsub.py races the two). Waits until then, past pushes that fail; the
        caller bounds the wait (cancels it)."""
        while True:
            data = self.claim(digest, size)
            if data is not None:
                return data
            fut = self._incoming.get(digest)
            if fut is not None:
                await asyncio.shield(fut)  # the reader resolves it however the read ends
                continue
            event = self._arrived.setdefault(digest, asyncio.Event())
            try:
                await event.wait()
            finally:
                if self._arrived.get(digest) is event:
                    del self._arrived[digest]

    def close(self) -> None:
        """Every link ends, and none opens after (a dial under way, a peer's new link or a
        reconnection's: one that came after close() left a link the peer kept pushing on)."""
        self._closed = True
        for link in list(self.out.values()) + [x for v in self.inn.values() for x in v]:
            self._drop(link)


def _rendezvous(digest: bytes, peer: str, forwarders) -> list[str]:
    """Which of `forwarders` push the body `digest` on to `peer`: the FORWARD_COPIES the
    rendezvous hash of body, peer and forwarder ranks first."""
    return sorted(forwarders, key=lambda p: hashlib.sha256(
        digest + peer.encode() + p.encode()).digest(), reverse=True)[:FORWARD_COPIES]


def _names(peers: list[str]) -> bytes:
    """A forward frame's list: u8 count, then per peer u8 length + its base58 id."""
    out = bytearray([len(peers)])
    for peer in peers:
        raw = peer.encode("ascii")
        out += bytes([len(raw)]) + raw
    return bytes(out)
