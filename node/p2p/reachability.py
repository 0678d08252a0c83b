"""Is this node reachable from the internet? The verdict, its evidence, and what to do.

A node is *public* when a peer dialled it back at an address it advertised (the dial-back
check, `DIALBACK_PROTOCOL`); otherwise it is behind a NAT or firewall, and then either
*relayed* (it holds a reservation on a relay, so others reach it through
`/p2p-circuit`), *direct* (also relayed, and hole punching (DCUtR) gave it at least one
direct connection), or *unreachable* (no relay slot: it can dial out, nobody can dial in).

`ReachabilityTracker` holds the current `Reachability` and calls listeners on every change,
on the asyncio loop. It is pure state (no libp2p): the checks that feed it live in
`dialback.py` and `relay.py`.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

log = logging.getLogger(__name__)


class Verdict(enum.StrEnum):
    UNKNOWN = "unknown"  # not checked yet (no peer to ask)
    PUBLIC = "public"  # peers dialled us back at an advertised address
    RELAYED = "relayed"  # behind NAT; reachable through a relay reservation
    DIRECT = "direct"  # behind NAT; relayed, and hole punching gave direct connections
    UNREACHABLE = "unreachable"  # behind NAT; no relay slot: nobody can dial in


ADVICE = {
    Verdict.UNKNOWN: "reachability not checked yet (no peer has answered a dial-back)",
    Verdict.PUBLIC: "publicly reachable: peers dial this node directly; nothing to do",
    Verdict.RELAYED: ("behind NAT, reachable through a relay: nothing to do (opening the "
                      "TCP port, or a port forward, makes it public and faster)"),
    Verdict.DIRECT: ("behind NAT, direct connections by hole punching where the other "
                     "side's NAT allows, relayed otherwise: nothing to do"),
    Verdict.UNREACHABLE: ("behind NAT and no relay slot: this node can dial out, but peers "
                          "behind NAT cannot reach it. Bootstrap through a public node (a "
                          "relay) or forward the TCP port"),
}


@dataclass(frozen=True)
class Reachability:
    """One snapshot. `public_addrs`: addresses a peer dialled us back at (empty unless
    public). `relay_addrs`: our `/p2p-circuit` addresses (one per relay reservation).
    `observed_addrs`: what peers saw as our address (identify). `direct_peers`: peers we
    reached by hole punching."""

    verdict: Verdict = Verdict.UNKNOWN
    public_addrs: tuple[str, ...] = ()
    relay_addrs: tuple[str, ...] = ()
    observed_addrs: tuple[str, ...] = ()
    direct_peers: int = 0
    checked_at: float = 0.0
    detail: str = ""  # why (e.g. "2 of 2 dial-backs failed: timed out")

    @property
    def public(self) -> bool:
        return self.verdict is Verdict.PUBLIC

    @property
    def advice(self) -> str:
        return ADVICE[self.verdict]

    def line(self) -> str:
        """The one line the node logs at start and on every change."""
        where = ""
        if self.public_addrs:
            where = f" at {self.public_addrs[0]}"
        elif self.relay_addrs:
            where = f" via {len(self.relay_addrs)} relay(s)"
        why = f" ({self.detail})" if self.detail else ""
        return f"reachability: {self.verdict.value}{where}{why}; {self.advice}"

    def as_dict(self) -> dict:
        """For /status (`p2p.reachability`) and the dashboard."""
        return {"verdict": self.verdict.value, "public": self.public, "advice": self.advice,
                "public_addrs": list(self.public_addrs), "relay_addrs": list(self.relay_addrs),
                "observed_addrs": list(self.observed_addrs), "direct_peers": self.direct_peers,
                "checked_at": self.checked_at, "detail": self.detail}


Listener = Callable[[Reachability], None]


@dataclass
class ReachabilityTracker:
    """The current verdict from three inputs: dial-back results, relay reservations and
    hole-punched connections. Call the `set_*` methods on the asyncio loop; listeners run
    there too, once per change of the snapshot's verdict or addresses."""

    current: Reachability = field(default_factory=Reachability)
    _listeners: list[Listener] = field(default_factory=list)
    _dialable: bool | None = None  # None: no dial-back answered yet

    def subscribe(self, fn: Listener) -> Callable[[], None]:
        """Call `fn(snapshot)` on every change; returns a function that unsubscribes."""
        self._listeners.append(fn)
        return lambda: self._listeners.remove(fn) if fn in self._listeners else None

    def set_dialback(self, dialable: bool, addrs: list[str], detail: str = "") -> None:
        self._dialable = dialable
        self._update(public_addrs=tuple(addrs) if dialable else (), detail=detail)

    def set_relay_addrs(self, addrs: list[str]) -> None:
        self._update(relay_addrs=tuple(addrs))

    def set_observed(self, addrs: list[str]) -> None:
        self._update(observed_addrs=tuple(addrs))

    def set_direct_peers(self, n: int) -> None:
        self._update(direct_peers=n)

    def _verdict(self, snap: Reachability) -> Verdict:
        if self._dialable is None:
            return Verdict.UNKNOWN
        if self._dialable:
            return Verdict.PUBLIC
        if not snap.relay_addrs:
            return Verdict.UNREACHABLE
        return Verdict.DIRECT if snap.direct_peers else Verdict.RELAYED

    def _update(self, **changes) -> None:
        before = self.current
        snap = replace(before, **changes)
        snap = replace(snap, verdict=self._verdict(snap), checked_at=time.time())
        self.current = snap
        if (snap.verdict, snap.public_addrs, snap.relay_addrs, snap.direct_peers > 0) == (
                before.verdict, before.public_addrs, before.relay_addrs, before.direct_peers > 0):
            return
        for fn in list(self._listeners):
            try:
                fn(snap)
            except Exception:  # a listener's bug must not stop the others
                log.exception("reachability listener %r failed", fn)
