"""A `swarm-node join` forked warm into a lab host (tests/launch.py, the launcher of the netlab
scenarios) is in that host's network namespace, as one started by `ip netns exec` would be."""

from __future__ import annotations

import os

from swarm_node.node.identity import Identity
from swarm_node.node.testing.netlab import Home, Host, Lab, Link, Topology
from swarm_node.node.testing.netlab.nsutil import NETNS_DIR
from swarm_node.node.testing.netlab.swarm import LabSwarm

from tests.launch import start_join_in

from .conftest import result, start

TOPO = Topology(hosts=[Host("srv", Link(latency_ms=1))],
                homes=[Home("home", "cone", Link(latency_ms=1), ["peer"])])


def test_a_forked_node_runs_in_its_hosts_namespace(netlab_ok, tmp_path, tiny_model_dir):
    with Lab(TOPO, prefix="launch") as lab, \
            LabSwarm(lab, tmp_path, tiny_model_dir, launch=start_join_in) as sw:
        # a TCP server on the public host that tells each client the address it came from;
        # the node dials it as its bootstrap peer (and keeps retrying: it is not a node)
        whoami, port = start(lab, "srv", "whoami", "0", "1")
        boot = f"/ip4/{lab.addr('srv')}/tcp/{port}/p2p/{Identity.generate().peer_id}"
        node = sw.start("peer", "peer", "relay", settings={"node": {"bootstrap": [boot]}})
        seen = result(whoami)["seen"]
        # its connection left from its LAN address (192.168.x.y:4001 exists only in its
        # namespace, where it listens) through its home router's NAT
        assert seen[0][0] == lab.public_addr("peer") != lab.addr("peer")
        assert node.proc.poll() is None, node.tail()
        ns_inode = os.stat(NETNS_DIR / lab.ns("peer")).st_ino
        assert os.stat(f"/proc/{node.proc.pid}/ns/net").st_ino == ns_inode
        assert os.stat("/proc/self/ns/net").st_ino != ns_inode
        assert node.proc.pid != os.getpid()
        sw.stop(node, kill=True)  # (a SIGTERM waits for the bootstrap to give up)
