"""The lab's typed description: sites on the simulated internet and the hosts in them.

A *site* has one access link to the internet router: a public host (the host is the site) or a
home router (a NAT with a LAN bridge and hosts behind it). Each access link has a one-way
latency, a random loss rate and up/down bandwidth; a path between two sites crosses both legs,
so its one-way delay is the sum of the two latencies (RTT = 2 x the sum) and its loss is
1 - (1 - a)(1 - b). Hosts behind one home router share its link, like a household.

Addresses: site i (1-based, in the order given: public hosts, then homes) is 11.0.i.2/24 with
the internet router at 11.0.i.1. The range is globally routable on purpose, so libp2p and
Python classify the lab's public hosts as public, like on the real internet; nothing leaves the
namespaces. Home k's LAN is 192.168.k.0/24, the router .1, its hosts .10, .11, ...
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

from .errors import NetlabError

NatType = Literal["cone", "symmetric"]
NAT_TYPES = ("cone", "symmetric")
MAX_SITES = 250
MAX_HOSTS_PER_HOME = 200
_NAME = re.compile(r"^[a-z][a-z0-9]{0,11}$")


@dataclass(frozen=True)
class Link:
    """An access link. `latency_ms` is one way, each direction; `loss` a probability per
    packet, each direction; bandwidth in Mbit/s (0: unlimited) is shaped by TBF at the sending
    end of each direction; `queue_ms` sizes the TBF queue (how long a full queue takes to
    drain), the bufferbloat of a home router."""

    latency_ms: float = 0.0
    loss: float = 0.0
    up_mbit: float = 0.0
    down_mbit: float = 0.0
    queue_ms: float = 100.0

    def __post_init__(self):
        if not 0.0 <= self.latency_ms <= 10_000.0:
            raise NetlabError(f"latency_ms must be in [0, 10000], got {self.latency_ms}")
        if not 0.0 <= self.loss < 1.0:
            raise NetlabError(f"loss must be in [0, 1), got {self.loss}")
        for name in ("up_mbit", "down_mbit"):
            rate = getattr(self, name)
            if not 0.0 <= rate <= 30_000.0:  # TBF's 32-bit rate holds up to ~34 Gbit/s
                raise NetlabError(f"{name} must be in [0, 30000] Mbit/s, got {rate}")
        if not 1.0 <= self.queue_ms <= 10_000.0:
            raise NetlabError(f"queue_ms must be in [1, 10000], got {self.queue_ms}")


@dataclass(frozen=True)
class Host:
    """A public host: its own site, reachable by its address."""

    name: str
    link: Link = Link()


@dataclass(frozen=True)
class Home:
    """A home router doing NAT for the hosts behind it. `cone`: Linux MASQUERADE (endpoint-
    independent, port-preserving mapping); `symmetric`: MASQUERADE fully-random (a new random
    public port per connection). Filtering is the conntrack's: only replies to what a LAN host
    sent get in; anything unsolicited is dropped silently, like a real home router."""

    name: str
    nat: NatType = "cone"
    link: Link = Link()
    hosts: tuple[str, ...] = ()


@dataclass(frozen=True)
class Topology:
    hosts: tuple[Host, ...] = ()
    homes: tuple[Home, ...] = ()
    # Names of the sites, their order fixes their addresses.
    sites: tuple[str, ...] = field(init=False)

    def __post_init__(self):
        object.__setattr__(self, "hosts", tuple(self.hosts))
        object.__setattr__(self, "homes", tuple(
            Home(h.name, h.nat, h.link, tuple(h.hosts)) for h in self.homes))
        names = [h.name for h in self.hosts] + [h.name for h in self.homes]
        names += [n for home in self.homes for n in home.hosts]
        for name in names:
            if not _NAME.match(name) or name == "inet":
                raise NetlabError(f"lab name {name!r}: use 1-12 lowercase letters/digits, "
                                  "starting with a letter (and not 'inet')")
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise NetlabError(f"lab names must be unique: {', '.join(dup)}")
        for home in self.homes:
            if home.nat not in NAT_TYPES:
                raise NetlabError(f"home {home.name}: nat must be one of {NAT_TYPES}, "
                                  f"got {home.nat!r}")
            if len(home.hosts) > MAX_HOSTS_PER_HOME:
                raise NetlabError(f"home {home.name}: at most {MAX_HOSTS_PER_HOME} hosts")
        sites = tuple(h.name for h in self.hosts) + tuple(h.name for h in self.homes)
        if len(sites) > MAX_SITES:
            raise NetlabError(f"at most {MAX_SITES} sites (public hosts + homes), "
                              f"got {len(sites)}")
        object.__setattr__(self, "sites", sites)

    def site_index(self, site: str) -> int:
        return self.sites.index(site) + 1

    def home_of(self, host: str) -> Home | None:
        return next((h for h in self.homes if host in h.hosts), None)

    def site_of(self, name: str) -> str:
        """The site whose access link carries `name`'s traffic (itself, or its home)."""
        home = self.home_of(name)
        if home is not None:
            return home.name
        if name in self.sites:
            return name
        raise NetlabError(f"no host or home named {name!r} in this lab")

    def link_of(self, site: str) -> Link:
        for h in (*self.hosts, *self.homes):
            if h.name == site:
                return h.link
        raise NetlabError(f"no site named {site!r} in this lab")

    def public_addr(self, name: str) -> str:
        """The address `name` has on the internet: its own, or its home router's."""
        return f"11.0.{self.site_index(self.site_of(name))}.2"

    def gateway_addr(self, site: str) -> str:
        return f"11.0.{self.site_index(site)}.1"

    def addr(self, name: str) -> str:
        """The address a process on `name` binds and sees as its own."""
        home = self.home_of(name)
        if home is None:
            return self.public_addr(name)
        k = self.homes.index(home) + 1
        return f"192.168.{k}.{10 + home.hosts.index(name)}"

    def lan_gateway(self, home: Home) -> str:
        return f"192.168.{self.homes.index(home) + 1}.1"

    def path_rtt_ms(self, a: str, b: str) -> float:
        """The configured round-trip time between two hosts (0 inside one home)."""
        sa, sb = self.site_of(a), self.site_of(b)
        if sa == sb:
            return 0.0
        return 2.0 * (self.link_of(sa).latency_ms + self.link_of(sb).latency_ms)

    def path_loss(self, a: str, b: str) -> float:
        """The configured loss of one packet from `a` to `b` (and back)."""
        sa, sb = self.site_of(a), self.site_of(b)
        if sa == sb:
            return 0.0
        return 1.0 - (1.0 - self.link_of(sa).loss) * (1.0 - self.link_of(sb).loss)

    @property
    def all_hosts(self) -> tuple[str, ...]:
        """Every host a process can run on (public hosts and hosts behind homes)."""
        return tuple(h.name for h in self.hosts) + tuple(
            n for home in self.homes for n in home.hosts)
