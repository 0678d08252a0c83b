"""A simulated internet for tests and benchmarks, built from Linux network namespaces.

`Topology` (topology.py) describes it: public hosts and home routers (NAT `cone` or
`symmetric`, hosts behind them), each site with an access `Link` (one-way latency, loss,
up/down Mbit/s). `Lab` (lab.py) builds it as namespaces around an "internet" router, shapes
bandwidth with TBF, writes NAT rules with nftables over netlink (nat.py), and runs the delay
stage (delay.py: a TUN device and a small user-space process that holds every transit packet
for its path's delay and drops it with its loss: this kernel has no netem). `Lab.popen` /
`Lab.run` start real processes inside a host.

Needs root, /dev/net/tun and pyroute2 (the `dev` extra). It imports no node code.
"""

from . import probe
from .errors import NetlabError
from .lab import Lab, wait_for
from .nsutil import unavailable_reason
from .topology import Home, Host, Link, Topology

__all__ = ["Home", "Host", "Lab", "Link", "NetlabError", "Topology", "probe", "unavailable_reason",
           "wait_for"]
