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


PEER_KINDS = ("public", "hole-punched", "relayed", "unreachable", "?")
MAX_PEER_REACH = 256  # peers /status reports a kind for (connected ones first)


def peer_reach(*, connected: set[str], relayed: set[str], outbound: set[str],
               punched: set[str], advertised: dict[str, list[str]],
               probed: dict[str, tuple[bool, str]]) -> dict[str, tuple[str, str]]:
    """How each peer this node knows is reachable, from what this node saw itself: peer ->
    (kind, evidence), kind one of PEER_KINDS. No message carries a verdict: a peer's own
    announcement is its addresses (a `/p2p-circuit` one means it is behind NAT and holds a
    relay slot), and the rest is this node's connections and the dial-back probes it
    answered for that peer. Evidence, strongest first:

    - our dial-back probe reached it: `public`; failed, and it names no relay: `unreachable`;
    - a direct connection to a peer behind NAT (it advertises a relay address, or DCUtR
      upgraded it): `hole-punched`; only relayed connections, or a relay address: `relayed`;
    - we dialled it directly at an address it advertised: `public`.
    `connected`: peers with an open connection; `relayed`: those whose every connection goes
    through a relay; `outbound`: those with a direct connection this node dialled;
    `punched`: those DCUtR upgraded; `advertised`: the addresses each announced;
    `probed`: the last dial-back probe this node ran for a peer (reached?, why not)."""
    out: dict[str, tuple[str, str]] = {}
    order = sorted(connected) + sorted(set(advertised) | set(probed) - connected)
    for peer in order[:MAX_PEER_REACH]:
        circuit = any("/p2p-circuit" in a for a in advertised.get(peer, ()))
        ok, why = probed.get(peer, (None, ""))
        direct = peer in connected and peer not in relayed
        if direct and (peer in punched or circuit):
            out[peer] = ("hole-punched", "direct connection to a peer behind NAT (DCUtR)")
        elif ok:
            out[peer] = ("public", "this node's dial-back probe reached it")
        elif peer in relayed or circuit:
            out[peer] = ("relayed", "advertises a relay address (behind NAT)" if circuit
                         else "connected only through a relay")
        elif ok is False:
            out[peer] = ("unreachable", (f"this node's dial-back probe failed "
                                         f"({why or '?'}) and it holds no relay slot"))
        elif direct and peer in outbound:
            out[peer] = ("public", "this node dialled it directly")
        else:
            out[peer] = ("?", "not known from here")
    return out
