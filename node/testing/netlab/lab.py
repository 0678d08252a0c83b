"""`Lab`: builds a `Topology` out of network namespaces and tears it down.

  <id>-inet         the internet router: one veth per site (s1, s2, ...), the TUN of the
                    delay stage (dly0); every packet between two sites is routed through it
  <id>-<host>       a public host: eth0 = 11.0.i.2/24, default via the router
  <id>-<home>       a home router: eth0 (WAN) = 11.0.i.2/24, br0 (LAN) = 192.168.k.1/24,
                    NAT + filter (nat.py), one veth per LAN host enslaved to br0
  <id>-<host>       a host behind a home: eth0 = 192.168.k.(10+j)/24, default via .1

Bandwidth: TBF on eth0 of the site (uplink) and on the site's veth in the router (downlink).
Delay and loss: the delay stage (delay.py), one process for the whole internet. `<id>` is
`<prefix><4 hex>`, unique per lab, so two labs (two test sessions) can coexist.

Policy routing in the router sends what arrives from a site to the TUN and what comes back
from the TUN by the main table:
  ip rule 100: iif dly0 lookup main;  ip rule 200: lookup 100;  table 100: default dev dly0
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Self

from pyroute2 import IPRoute
from pyroute2.netlink.exceptions import NetlinkError

from . import delay, nat, nsutil
from .errors import NetlabError
from .topology import Home, Link, Topology

TUN = "dly0"
TUN_TABLE = 100
TUN_QUEUE = 10_000  # packets
MAIN_TABLE = 254
RULE_FROM_TUN, RULE_TO_TUN = 100, 200
STAGE_TIMEOUT_S = 30.0
TBF_HANDLE = 0x10000  # 1:
MIN_BURST = 8 * 1024


class Lab:
    """A simulated internet. Use as a context manager; everything it made is removed on exit,
    also after an error (processes it started, every process left in its namespaces, the
    namespaces, the delay stage).

    >>> topo = Topology(hosts=[Host("srv", Link(latency_ms=10))],
    ...                 homes=[Home("home1", "cone", Link(latency_ms=20), ["alice"])])
    >>> with Lab(topo) as lab:
    ...     lab.run("alice", ["python3", "-c", "print(1)"])
    """

    def __init__(self, topology: Topology, prefix: str = "netlab", seed: int = 0):
        if not prefix.isalnum() or not prefix.islower() or len(prefix) > 8:
            raise NetlabError("lab prefix: 1-8 lowercase letters/digits")
        self.topology = topology
        self.id = f"{prefix}{secrets.token_hex(2)}"
        self.seed = seed
        self._namespaces: list[str] = []
        self._procs: list[subprocess.Popen] = []
        self._stage: subprocess.Popen | None = None
        self._registry: Path | None = None
        self._links: dict[str, Link] = {s: topology.link_of(s) for s in topology.sites}
        self._groups: list[list[str]] = []

    # --- names -------------------------------------------------------------------------

    def ns(self, name: str) -> str:
        """The network namespace of a host, a home router, or "inet" (the router)."""
        if name != "inet" and name not in self.topology.sites and \
                name not in self.topology.all_hosts:
            raise NetlabError(f"no host or home named {name!r} in this lab")
        return f"{self.id}-{name}"

    def addr(self, host: str) -> str:
        """The address `host` binds and sees as its own (a LAN address behind a NAT)."""
        return self.topology.addr(host)

    def public_addr(self, host: str) -> str:
        """The address the internet sees for `host` (its home router's, behind a NAT)."""
        return self.topology.public_addr(host)

    # --- lifecycle ---------------------------------------------------------------------

    def __enter__(self) -> Self:
        try:
            self.build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def build(self) -> None:
        reason = nsutil.unavailable_reason()
        if reason:
            raise NetlabError(reason)
        nsutil.sweep_stale()
        topo = self.topology
        names = ["inet", *topo.sites, *(h for home in topo.homes for h in home.hosts)]
        self._namespaces = [self.ns(n) for n in names]
        self._registry = nsutil.register(self.id, self._namespaces)
        for name in self._namespaces:
            nsutil.create(name)
        nsutil.in_netns(self.ns("inet"), self._setup_router)
        for host in topo.hosts:
            self._setup_site(host.name)
        for home in topo.homes:
            self._setup_site(home.name)
            self._setup_home(home)
        self._start_stage()

    def close(self) -> None:
        for proc in self._procs:
            _stop(proc)
        self._procs.clear()
        if self._stage is not None:
            _stop(self._stage, grace_s=2.0)
            self._stage = None
        existing = [n for n in self._namespaces if (nsutil.NETNS_DIR / n).exists()]
        nsutil.kill_all_in(existing)
        for name in existing:
            nsutil.remove(name)
        self._namespaces = []
        if self._registry is not None:
            self._registry.unlink(missing_ok=True)
            self._registry = None

    # --- building ----------------------------------------------------------------------

    def _setup_router(self) -> None:
        nsutil.sysctl("net.ipv4.ip_forward", "1")
        for scope in ("all", "default"):
            nsutil.sysctl(f"net.ipv4.conf.{scope}.rp_filter", "0")
        with IPRoute() as ipr:
            ipr.link("set", index=ipr.link_lookup(ifname="lo")[0], state="up")
            for site in self.topology.sites:
                i = self.topology.site_index(site)
                ipr.link("add", ifname=f"s{i}", kind="veth",
                         peer={"ifname": nat.WAN, "net_ns_fd": self.ns(site)})
                idx = ipr.link_lookup(ifname=f"s{i}")[0]
                ipr.addr("add", index=idx, address=self.topology.gateway_addr(site),
                         prefixlen=24)
                ipr.link("set", index=idx, state="up")
                _shape(ipr, idx, self._links[site].down_mbit, self._links[site].queue_ms)

    def _setup_site(self, site: str) -> None:
        topo = self.topology
        is_home = any(h.name == site for h in topo.homes)

        def setup():
            if is_home:
                nsutil.sysctl("net.ipv4.ip_forward", "1")
            with IPRoute() as ipr:
                ipr.link("set", index=ipr.link_lookup(ifname="lo")[0], state="up")
                idx = ipr.link_lookup(ifname=nat.WAN)[0]
                ipr.addr("add", index=idx, address=topo.public_addr(site), prefixlen=24)
                ipr.link("set", index=idx, state="up")
                ipr.route("add", dst="0.0.0.0/0", gateway=topo.gateway_addr(site))
                _shape(ipr, idx, self._links[site].up_mbit, self._links[site].queue_ms)

        nsutil.in_netns(self.ns(site), setup)

    def _setup_home(self, home: Home) -> None:
        topo = self.topology
        gw = topo.lan_gateway(home)

        def router():
            with IPRoute() as ipr:
                ipr.link("add", ifname="br0", kind="bridge")
                br = ipr.link_lookup(ifname="br0")[0]
                ipr.addr("add", index=br, address=gw, prefixlen=24)
                ipr.link("set", index=br, state="up")
                for j, host in enumerate(home.hosts):
                    ipr.link("add", ifname=f"h{j}", kind="veth",
                             peer={"ifname": "eth0", "net_ns_fd": self.ns(host)})
                    idx = ipr.link_lookup(ifname=f"h{j}")[0]
                    ipr.link("set", index=idx, master=br, state="up")
            nat.install_home_nat(home.nat)

        nsutil.in_netns(self.ns(home.name), router)
        for host in home.hosts:
            def lan_host(host=host):
                with IPRoute() as ipr:
                    ipr.link("set", index=ipr.link_lookup(ifname="lo")[0], state="up")
                    idx = ipr.link_lookup(ifname="eth0")[0]
                    ipr.addr("add", index=idx, address=topo.addr(host), prefixlen=24)
                    ipr.link("set", index=idx, state="up")
                    ipr.route("add", dst="0.0.0.0/0", gateway=gw)

            nsutil.in_netns(self.ns(host), lan_host)

    def _start_stage(self) -> None:
        self._stage = subprocess.Popen(
            ["ip", "netns", "exec", self.ns("inet"), sys.executable, delay.__file__, TUN,
             str(self.seed)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            start_new_session=True)
        self._stage_reply()  # {"ready": true}: the TUN exists

        def route():
            with IPRoute() as ipr:
                idx = ipr.link_lookup(ifname=TUN)[0]
                # a long queue: a burst waits for the stage rather than being dropped
                ipr.link("set", index=idx, state="up", txqlen=TUN_QUEUE)
                ipr.route("add", dst="0.0.0.0/0", oif=idx, table=TUN_TABLE)
                ipr.rule("add", iifname=TUN, table=MAIN_TABLE, priority=RULE_FROM_TUN)
                ipr.rule("add", table=TUN_TABLE, priority=RULE_TO_TUN)

        nsutil.in_netns(self.ns("inet"), route)
        self._send_links()

    # --- the delay stage's control channel ----------------------------------------------

    def _stage_call(self, msg: dict) -> dict:
        if self._stage is None or self._stage.poll() is not None:
            raise NetlabError("the lab's delay stage is not running" + self._stage_err())
        self._stage.stdin.write(json.dumps(msg).encode() + b"\n")
        self._stage.stdin.flush()
        reply = self._stage_reply()
        if not reply.get("ok"):
            raise NetlabError(f"delay stage refused {msg.get('op')}: {reply.get('error')}")
        return reply

    def _stage_reply(self) -> dict:
        with selectors.DefaultSelector() as sel:
            sel.register(self._stage.stdout, selectors.EVENT_READ)
            if not sel.select(STAGE_TIMEOUT_S):
                raise NetlabError("the lab's delay stage did not answer within "
                                  f"{STAGE_TIMEOUT_S:.0f}s")
        line = self._stage.stdout.readline()
        if not line:
            raise NetlabError("the lab's delay stage exited" + self._stage_err())
        return json.loads(line)

    def _stage_err(self) -> str:
        if self._stage is None or self._stage.poll() is None:
            return ""
        return f" (exit {self._stage.returncode}): {self._stage.stderr.read().decode()[-500:]}"

    def _send_links(self) -> None:
        self._stage_call({"op": "links", "links": {
            self.topology.public_addr(site): [link.latency_ms / 1000.0, link.loss]
            for site, link in self._links.items()}})

    # --- changing the network while it runs ---------------------------------------------

    def set_link(self, site: str, link: Link) -> None:
        """Change a site's access link (latency, loss at once; bandwidth by TBF replace)."""
        old = self._links[self.topology.site_of(site)]
        site = self.topology.site_of(site)
        self._links[site] = link
        self._send_links()
        if (old.up_mbit, old.queue_ms) != (link.up_mbit, link.queue_ms):
            def up():
                with IPRoute() as ipr:
                    _shape(ipr, ipr.link_lookup(ifname=nat.WAN)[0], link.up_mbit,
                           link.queue_ms, replace=True)
            nsutil.in_netns(self.ns(site), up)
        if (old.down_mbit, old.queue_ms) != (link.down_mbit, link.queue_ms):
            i = self.topology.site_index(site)

            def down():
                with IPRoute() as ipr:
                    _shape(ipr, ipr.link_lookup(ifname=f"s{i}")[0], link.down_mbit,
                           link.queue_ms, replace=True)
            nsutil.in_netns(self.ns("inet"), down)

    def partition(self, *groups: Sequence[str]) -> None:
        """Cut the internet between groups of hosts/homes (each group still reaches itself;
        a site in no group reaches everyone). A home's hosts go with their home."""
        sites = [sorted({self.topology.site_of(n) for n in g}) for g in groups]
        seen = [s for g in sites for s in g]
        if len(seen) != len(set(seen)):
            raise NetlabError("a site is in two partition groups (hosts behind one home "
                              "share its link)")
        self._groups = sites
        self._stage_call({"op": "partition", "groups": [
            [self.topology.public_addr(s) for s in g] for g in sites]})

    def heal(self) -> None:
        self._groups = []
        self._stage_call({"op": "heal"})

    def link_bytes(self, site: str) -> dict[str, int]:
        """Bytes (IP packets, headers included) a site sent ("tx") to and received ("rx")
        from the internet so far, counted on its access link (eth0)."""
        site = self.topology.site_of(site)

        def read():
            with IPRoute() as ipr:
                link = ipr.get_links(ipr.link_lookup(ifname=nat.WAN)[0])[0]
                stats = link.get_attr("IFLA_STATS64")
                return {"tx": stats["tx_bytes"], "rx": stats["rx_bytes"]}

        return nsutil.in_netns(self.ns(site), read)

    def stage_stats(self) -> dict:
        """The delay stage's counters: reads (packets read from the TUN, GSO packets
        whole), packets (wire packets: a GSO packet counts as its segments), bytes, lost (by the configured loss, in wire packets), split (GSO packets
        cut to drop single segments), partitioned, max_held, late_2ms/late_10ms (released that
        long after their due time: the stage fell behind), tun_drops (dropped before the stage
        read them), cpu_s."""
        return self._stage_call({"op": "stats"})["stats"]

    # --- processes -----------------------------------------------------------------------

    def popen(self, host: str, argv: Sequence[str], env: dict | None = None,
              **kwargs) -> subprocess.Popen:
        """Start a process inside `host`'s namespace (own session, stopped by `close`)."""
        full = ["ip", "netns", "exec", self.ns(host), *argv]
        proc = subprocess.Popen(full, env=env, start_new_session=True, **kwargs)
        self._procs.append(proc)
        return proc

    def run(self, host: str, argv: Sequence[str], timeout: float = 60.0,
            env: dict | None = None, check: bool = False) -> subprocess.CompletedProcess:
        """Run a process inside `host`'s namespace to its end; its output is captured."""
        proc = self.popen(host, argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _stop(proc)
            out, err = proc.communicate()
            raise NetlabError(f"{host}: {' '.join(argv)} ran past {timeout:.0f}s; "
                              f"stderr: {err.decode(errors='replace')[-500:]}") from None
        finally:
            self._procs.remove(proc)
        result = subprocess.CompletedProcess(list(argv), proc.returncode, out, err)
        if check and proc.returncode != 0:
            raise NetlabError(f"{host}: {' '.join(argv)} exited {proc.returncode}: "
                              f"{err.decode(errors='replace')[-500:]}")
        return result


def _shape(ipr: IPRoute, index: int, mbit: float, queue_ms: float,
           replace: bool = False) -> None:
    """TBF at `mbit` on the device's egress; 0 removes any shaping."""
    if not mbit:
        if replace:
            try:
                ipr.tc("del", index=index, handle=TBF_HANDLE)
            except NetlinkError as e:
                if e.code not in (errno.ENOENT, errno.EINVAL):  # not "no such qdisc"
                    raise
        return
    rate = int(mbit * 1e6 / 8)  # bytes/s
    burst = max(MIN_BURST, rate // 1000)  # 1 ms at line rate, at least a few packets
    limit = int(rate * queue_ms / 1000.0) + burst
    ipr.tc("replace" if replace else "add", "tbf", index, TBF_HANDLE, rate=rate,
           burst=burst, limit=limit)


def _stop(proc: subprocess.Popen, grace_s: float = 5.0) -> None:
    """SIGTERM the process's session, SIGKILL it after `grace_s`."""
    if proc.poll() is not None:
        return
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def wait_for(pred, timeout: float, what: str, poll: float = 0.05):
    """Poll `pred` until it returns a true value (returned) or `timeout` passes."""
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise NetlabError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(poll)
