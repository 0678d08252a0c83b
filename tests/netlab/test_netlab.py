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
    sink, port = start(lab, "lossy", "udp-sink", "0", "1")
    run(lab, "srv", "udp-send", lab.addr("lossy"), str(port), str(n), "4000")
    lost = n - result(sink)["received"]
    sigma = math.sqrt(n * p * (1 - p))
    assert abs(lost - n * p) < 5 * sigma, (lost, n * p)


def test_a_natted_host_dials_out_but_cannot_be_dialled(lab):
    srv, port = start(lab, "alice", "whoami", "0", "1")
    for target in (lab.public_addr("alice"), lab.addr("alice")):
        done = lab.run("srv", [*PROBE, "ask", target, str(port), "0", "1.5"], timeout=30)
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
                           "3"], stdout=-1, stderr=-1) for i, h in enumerate((a, b))]
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
    done = lab.run("alice", [*PROBE, "ask", lab.addr("srv"), str(port), "0", "1.5"], timeout=30)
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


def test_link_bytes_count_what_a_site_sent(lab):
    before = lab.link_bytes("alice")  # alice's home router's access link
    server, port = start(lab, "srv", "sink", "0")
    run(lab, "alice", "send", lab.addr("srv"), str(port), str(300_000))
    result(server)
    after = lab.link_bytes("cone1")
    assert 300_000 <= after["tx"] - before["tx"] < 330_000  # payload + TCP/IP headers


def _gso_packet(payload: bytes, gso_size: int, flags: int = 0x18 | 0x01 | 0x80) -> bytes:
    """A TCP/IPv4 GSO packet as the TUN hands it over (virtio header + IP + TCP + data)."""
    import socket
    import struct

    from swarm_node.node.testing.netlab import delay

    ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + 20 + len(payload), 1000, 0x4000, 64, 6, 0,
                     socket.inet_aton("11.0.1.2"), socket.inet_aton("11.0.2.2"))
    tcp = struct.pack("!HHIIBBHHH", 4001, 50000, 0xFFFFFF00, 7, 5 << 4, flags, 512, 0, 0)
    vnet = delay.VNET_HDR.pack(delay.VNET_F_NEEDS_CSUM, delay.VNET_GSO_TCPV4, 40, gso_size,
                               20, 16)
    return vnet + ip + tcp + payload


def test_a_gso_packet_splits_into_its_wire_segments():
    import struct

    from swarm_node.node.testing.netlab import delay

    payload = bytes(range(256)) * 20  # 5120 bytes: 3 full segments of 1448 and one of 776
    pkt = _gso_packet(payload, 1448)
    assert delay.tcp4_segments(pkt) == 4
    segs = delay.split_tcp4(pkt)
    assert len(segs) == 4
    data = b""
    for i, seg in enumerate(segs):
        vflags, gso_type, _, gso_size, cstart, coff = delay.VNET_HDR.unpack_from(seg)
        assert (vflags, gso_type, gso_size, cstart, coff) == (1, 0, 0, 20, 16)
        ip, tcp = seg[10:30], seg[30:50]
        assert struct.unpack("!H", ip[2:4])[0] == len(seg) - 10  # IP total length
        assert struct.unpack("!H", ip[4:6])[0] == 1000 + i  # IP id per segment, as TSO
        assert delay._sum16(ip) == 0xFFFF  # a valid IP header checksum
        assert struct.unpack("!I", tcp[4:8])[0] == (0xFFFFFF00 + i * 1448) & 0xFFFFFFFF
        tcp_flags = tcp[13]
        assert bool(tcp_flags & 0x01) == bool(tcp_flags & 0x08) == (i == 3)  # FIN, PSH last
        assert bool(tcp_flags & 0x80) == (i == 0)  # CWR first
        pseudo = ip[12:20] + struct.pack("!HH", 6, len(seg) - 30)
        assert struct.unpack("!H", tcp[16:18])[0] == delay._sum16(pseudo)
        data += seg[50:]
    assert data == payload
    plain = _gso_packet(b"x" * 100, 0)  # no GSO: one wire packet, never split
    assert delay.tcp4_segments(plain) == 1


def test_ones_complement_sum_matches_the_word_by_word_definition():
    import random

    from swarm_node.node.testing.netlab import delay

    def reference(data: bytes) -> int:
        data += b"\0" * (len(data) % 2)
        total = 0
        for i in range(0, len(data), 2):
            total += (data[i] << 8) | data[i + 1]
            total = (total & 0xFFFF) + (total >> 16)
        return total

    rng = random.Random(1)
    cases = [b"", b"\0\0", b"\xff\xff", b"\xff\xff\xff\xff", b"\x01"]
    cases += [rng.randbytes(rng.randrange(1, 64)) for _ in range(500)]
    for data in cases:
        assert delay._sum16(data) == reference(data), data


def test_bulk_tcp_over_a_lossy_path_loses_wire_segments_not_gso_packets(lab):
    """2% loss on alice's uplink towards srv2: the stage drops ~2% of the wire segments
    (GSO packets are split when one of their segments is lost) and TCP still delivers every
    byte in order."""
    from swarm_node.node.testing.netlab import Link

    lab.set_link("cone1", Link(latency_ms=20, loss=0.02))
    try:
        s0 = lab.stage_stats()
        server, port = start(lab, "srv2", "sink", "0")
        size = 3_000_000
        run(lab, "alice", "send", lab.addr("srv2"), str(port), str(size), timeout=120)
        assert result(server)["bytes"] == size
        s1 = lab.stage_stats()
        segments, lost = s1["packets"] - s0["packets"], s1["lost"] - s0["lost"]
        assert segments > size / 1500  # counted per wire segment (ACKs on top)
        assert s1["split"] > s0["split"]  # GSO packets were cut to drop single segments
        # acks and data both cross the lossy leg; 2% per segment, statistically
        sigma = math.sqrt(segments * 0.02 * 0.98)
        assert abs(lost - 0.02 * segments) < 5 * sigma, (lost, segments)
    finally:
        lab.set_link("cone1", TOPO.link_of("cone1"))
