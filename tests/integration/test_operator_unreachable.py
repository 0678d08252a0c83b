"""The `unreachable` banner from a real node that nobody can dial (issue 29): an inference peer
behind a symmetric home NAT (netlab namespaces, nftables NAT) joins a public trainer, and the
swarm has no relay. Its dial-back check fails and no relay slot can be had, so its verdict is
`unreachable`; its dashboard, rendered in headless Chromium inside the peer's own namespace
(the admin endpoint is that namespace's 127.0.0.1), shows the banner naming the fix, and the
trainer's swarm view says the peer cannot be dialled while the peer sees the trainer as
public. Real `swarm-node join` processes, tiny model; root and network namespaces needed
(skipped with one reason otherwise).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from tests.launch import start_join_in

from .test_operator_views import CHROMIUM, banners

try:
    from swarm_node.node.testing import netlab
    from swarm_node.node.testing.netlab.swarm import LabSwarm
except ImportError:  # the lab lands with the WAN work package
    netlab = None

pytestmark = [
    pytest.mark.slow, pytest.mark.timeout(600),
    pytest.mark.skipif(netlab is None or netlab.unavailable_reason() is not None,
                       reason=("node/testing/netlab is not on this branch" if netlab is None
                               else (netlab.unavailable_reason() or ""))),
]


def dashboard_in(lab, host: str, port: int, tmp_path: Path, shot: str) -> str:
    """The dashboard's DOM, rendered by headless Chromium run inside `host`'s namespace (its
    admin endpoint listens on that namespace's loopback), and a screenshot (kept under
    SWARM_DASHBOARD_DIR when that is set)."""
    if CHROMIUM is None:
        pytest.skip("chromium is not installed (apt-get install -y chromium)")
    url = f"http://127.0.0.1:{port}/dashboard"
    flags = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
             f"--user-data-dir={tmp_path / ('chromium-' + host)}",
             "--virtual-time-budget=6000", "--window-size=1100,1500"]
    dom = lab.run(host, [*flags, "--dump-dom", url], timeout=120).stdout.decode()
    assert 'data-ready="1"' in dom, dom[:3000]
    path = Path(os.environ.get("SWARM_DASHBOARD_DIR") or tmp_path) / shot
    lab.run(host, [*flags, f"--screenshot={path}", url], timeout=120)
    assert path.stat().st_size > 10_000
    return dom


def reach_of(status: dict, peer: str) -> str:
    rows = {r.get("peer"): r for r in (status.get("swarm") or {}).get("peers", [])}
    return (rows.get(peer) or {}).get("reach", "")


def test_a_peer_nobody_can_dial_shows_the_unreachable_banner_with_its_fix(tmp_path,
                                                                         tiny_model_dir):
    link = netlab.Link(latency_ms=5)
    topo = netlab.Topology(hosts=(netlab.Host("pub", link),),
                           homes=(netlab.Home("home", "symmetric", link, ("peer",)),))
    with netlab.Lab(topo, prefix="o3unr") as lab, \
            LabSwarm(lab, tmp_path / "swarm", tiny_model_dir, launch=start_join_in) as sw:
        trainer = sw.start("trainer", "pub", "trainer")  # no relay service: not a relay role
        sw.wait_started(trainer)
        peer = sw.start("peer", "peer", "inference", bootstrap=[trainer], follow=[trainer])
        sw.wait_started(peer)

        def unreachable() -> bool:
            codes = [a.get("code") for a in peer.status.get("alerts", [])]
            return ("unreachable" in codes
                    and reach_of(trainer.status, peer.peer_id) == "unreachable"
                    and reach_of(peer.status, trainer.peer_id) == "public")

        sw.wait_until(unreachable, 120, "the peer unreachable, as it and the trainer see it",
                      every=2.0)
        verdict = peer.status["p2p"]["reachability"]
        assert verdict["verdict"] == "unreachable" and not verdict["relay_addrs"], verdict
        alert = next(a for a in peer.status["alerts"] if a["code"] == "unreachable")
        assert "no relay slot" in alert["fix"] and "forward the TCP port" in alert["fix"]

        # the join line it offers names the trainer it joined through, not its LAN address
        assert f"--bootstrap {trainer.addr} " in peer.status["join_command"], peer.status
        dom = dashboard_in(lab, "peer", peer.info["admin_port"], tmp_path, "unreachable.png")
        assert "unreachable" in banners(dom), banners(dom)
        assert "Unreachable: other peers cannot dial this node" in dom
        assert "Bootstrap through a public node (a relay) or forward the TCP port" in dom

        dom = dashboard_in(lab, "pub", trainer.info["admin_port"], tmp_path, "trainer.png")
        cell = re.search(r'class="[^"]*reach-unreachable[^"]*">unreachable<', dom)
        assert cell, "the trainer's swarm table marks the NAT'd peer unreachable"
        assert set(sw.stop_all().values()) == {0}
