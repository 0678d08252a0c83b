"""The simulated internet itself, proved with plain sockets in real namespaces: routing, the
configured delay and loss, the two NAT types, a TCP hole punch, a bandwidth cap, partitions
and teardown. One lab serves the module (it builds in well under a second)."""

from __future__ import annotations

import math
import os

import pytest
from swarm_node.node.testing.netlab import Home, Host, Lab, Link, NetlabError, Topology
from swarm_node.node.testing.netlab.nsutil import NETNS_DIR

from .conftest import PROBE, result, run, start

TOPO = Topology(
    hosts=[Host("srv", Link(latency_ms=10)), Host("srv2", Link(latency_ms=4)),
           Host("lossy", Link(latency_ms=1, loss=0.10))],
    homes=[Home("cone1", "cone", Link(latency_ms=20), ["alice"]),
           Home("cone2", "cone", Link(latency_ms=15), ["bob"]),
           Home("sym1", "symmetric", Link(latency_ms=5), ["carol"]),
           Home("sym2", "symmetric", Link(latency_ms=5), ["dave"]),
           Home("slow", "cone", Link(latency_ms=2, up_mbit=4, down_mbit=16), ["erin"])],
)


@pytest.fixture(scope="module")
def lab(netlab_ok):
    with Lab(TOPO, prefix="wan") as lab:
        yield lab


def test_tcp_across_the_internet_and_out_of_a_nat(lab):
    srv, port = start(lab, "srv", "whoami", "0", "2")
    seen_public = run(lab, "srv2", "ask", lab.addr("srv"), str(port))["seen"]
    seen_natted = run(lab, "alice", "ask", lab.addr("srv"), str(port))["seen"]
    assert seen_public[0] == lab.addr("srv2") == "11.0.2.2"
    # the server sees alice's home router, not her LAN address
    assert lab.addr("alice").startswith("192.168.")
    assert seen_natted[0] == lab.public_addr("alice") != lab.addr("alice")
    result(srv)


def test_rtt_is_at_least_the_configured_path_rtt(lab):
    echo, port = start(lab, "srv", "echo", "0")
    samples = run(lab, "alice", "rtt", lab.addr("srv"), str(port), "20")["rtt_s"]
    result(echo)
    configured = TOPO.path_rtt_ms("alice", "srv") / 1000.0  # 2 x (20 + 10) ms
    assert configured == pytest.approx(0.060)
    assert min(samples) >= configured


def test_loss_matches_the_configured_rate(lab):
    n, p = 2000, TOPO.path_loss("srv", "lossy")  # 10% on lossy's leg
    sink, port = start(lab, "lossy", "udp-sink", "0", "2")
    run(lab, "srv", "udp-send", lab.addr("lossy"), str(port), str(n), "4000")
    lost = n - result(sink)["received"]
    sigma = math.sqrt(n * p * (1 - p))
    assert abs(lost - n * p) < 5 * sigma, (lost, n * p)


def test_a_natted_host_dials_out_but_cannot_be_dialled(lab):
    srv, port = start(lab, "alice", "whoami", "0", "1")
    for target in (lab.public_addr("alice"), lab.addr("alice")):
        done = lab.run("srv", [*PROBE, "ask", target, str(port), "0", "2"], timeout=30)
        assert done.returncode != 0  # timed out or unreachable: never connected
    srv.kill()
    srv.wait()


def test_cone_keeps_the_public_port_symmetric_does_not(lab):
    servers = [start(lab, h, "whoami", "0", "4") for h in ("srv", "srv2")]
    seen = {}
    for host, local in (("alice", 40001), ("carol", 40002)):
        seen[host] = [run(lab, host, "ask", lab.addr(s), str(p), str(local))["seen"][1]
                      for s, (_, p) in zip(("srv", "srv2"), servers, strict=True)]
        seen[host] += [run(lab, host, "ask", lab.addr("srv"), str(servers[0][1]),
                           str(local + 100))["seen"][1]]
    # cone: port-preserving and the same towards both servers
    assert seen["alice"][:2] == [40001, 40001] and seen["alice"][2] == 40101
    # symmetric: a fresh random public port per destination
    assert seen["carol"][0] != seen["carol"][1], seen["carol"]
    for proc, _ in servers:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize(("a", "b", "expect"), [("alice", "bob", True),
                                                ("carol", "dave", False)])
def test_tcp_hole_punch_works_between_cones_not_between_symmetric_nats(lab, a, b, expect):
    rv, port = start(lab, "srv", "rendezvous", "0")
    procs = [lab.popen(h, [*PROBE, "punch", lab.addr("srv"), str(port), str(41000 + i),
                           "4"], stdout=-1, stderr=-1) for i, h in enumerate((a, b))]
    outcomes = [result(p) for p in procs]
    result(rv)
    assert [o["connected"] for o in outcomes] == [expect, expect], outcomes


def test_bandwidth_cap_holds(lab):
    link = TOPO.link_of("slow")  # erin's home: 4 Mbit/s up, 16 down
    size = str(int(link.down_mbit * 1e6 / 8 * 1.5))  # 1.5 s at the cap
    server, port = start(lab, "srv", "source", "0", size)
    down = run(lab, "erin", "fetch", lab.addr("srv"), str(port))
    result(server)
    size = str(int(link.up_mbit * 1e6 / 8 * 1.5))
    server, port = start(lab, "srv", "sink", "0")
    run(lab, "erin", "send", lab.addr("srv"), str(port), size)
    up = result(server)
    for got, mbit in ((down, link.down_mbit), (up, link.up_mbit)):
        rate_mbit = got["after_first"] * 8 / got["span_s"] / 1e6
        # the payload rate after the first read never beats the shaped link (its burst aside)
        assert rate_mbit <= mbit * 1.1, (rate_mbit, mbit)


def test_partition_cuts_and_heal_restores(lab):
    srv, port = start(lab, "srv", "whoami", "0", "1")
    lab.partition(["srv"], ["alice", "srv2"])
    done = lab.run("alice", [*PROBE, "ask", lab.addr("srv"), str(port), "0", "2"], timeout=30)
    assert done.returncode != 0
    assert lab.stage_stats()["partitioned"] > 0
    lab.heal()
    assert run(lab, "alice", "ask", lab.addr("srv"), str(port))["seen"][0] == \
        lab.public_addr("alice")
    result(srv)


def test_two_labs_coexist_and_teardown_removes_everything(netlab_ok):
    topo = Topology(hosts=[Host("a")], homes=[Home("h", "cone", Link(), ["b"])])
    with Lab(topo, prefix="wan") as one, Lab(topo, prefix="wan") as two:
        assert one.id != two.id
        names = [one.ns(n) for n in ("inet", "a", "h", "b")]
        assert all((NETNS_DIR / n).exists() for n in names)
        proc = one.popen("b", ["sleep", "300"])
        srv, port = start(two, "a", "whoami", "0", "1")
        assert run(two, "b", "ask", two.addr("a"), str(port))["seen"][0] == two.public_addr("b")
        result(srv)
    assert proc.poll() is not None
    assert not any((NETNS_DIR / n).exists() for n in names)
    assert not [n for n in os.listdir(NETNS_DIR) if n.startswith((one.id, two.id))]


def test_bad_topologies_are_refused_with_a_clear_error():
    with pytest.raises(NetlabError, match="unique"):
        Topology(hosts=[Host("a")], homes=[Home("h", hosts=["a"])])
    with pytest.raises(NetlabError, match="nat must be one of"):
        Topology(homes=[Home("h", "full-cone")])
    with pytest.raises(NetlabError, match="loss"):
        Link(loss=1.5)
    with pytest.raises(NetlabError, match="lowercase"):
        Topology(hosts=[Host("Trainer-1")])


def test_the_lab_imports_no_node_code_and_its_scripts_only_the_stdlib():
    """netlab sits in the testing kit but stands alone (other packages' tests build on it);
    delay.py and probe.py run as plain scripts inside namespaces."""
    import ast
    import sys
    from pathlib import Path

    from swarm_node.node.testing import netlab

    for path in Path(netlab.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                assert not name.startswith("swarm_node"), (path.name, name)
                if path.name in ("delay.py", "probe.py"):
                    assert name.split(".")[0] in sys.stdlib_module_names, (path.name, name)
