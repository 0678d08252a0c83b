"""A peer of another swarm is told at once, in one line, which --swarm to pass (#29)."""

from __future__ import annotations

import logging

import pytest
from swarm_node.node.identity import Identity
from swarm_node.node.p2p import BootstrapError, P2PNode

from .conftest import p2p_config, wait_until


async def test_swarm_id_mismatch_is_one_error_line_at_once(make_node, caplog):
    boot = await make_node(node={"swarm_id": "my-swarm"})
    cfg = p2p_config()  # swarm "default"
    stray = P2PNode(Identity.generate(), cfg)
    caplog.set_level(logging.INFO)
    with pytest.raises(BootstrapError) as e:
        await stray.start(bootstrap=boot.listen_addrs)
    text = str(e.value)
    assert "'my-swarm'" in text and "'default'" in text and "--swarm my-swarm" in text
    # said once: by the error the command prints, not also by an ERROR log line before it.
    # Both nodes log into this process: only the stray's lines ("this node to 'default'")
    # count; the boot node may say its side when the stray's peer exchange reaches it first
    # (seen once in a whole-suite run, load ~4)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR
                and "this node to 'default'" in r.getMessage()]
    assert not any("failed" in r.getMessage() for r in caplog.records
                   if r.name.endswith("requests"))
    assert boot.discovery.is_stray(stray.peer_id)


async def test_one_mismatched_bootstrap_peer_of_two_is_reported_not_fatal(make_node, caplog):
    member = await make_node()
    other = await make_node(node={"swarm_id": "elsewhere"})
    caplog.set_level(logging.ERROR)
    node = await make_node(bootstrap=member.listen_addrs + other.listen_addrs)
    assert member.peer_id in node.connected_peers()
    # only the joining node's lines count (all three log into this process; `other` may
    # say its side, "this node to 'elsewhere'", as the boot node of the test above may)
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR
             and "this node to 'default'" in r.getMessage()]
    assert len(lines) == 1 and "--swarm elsewhere" in lines[0]
    assert other.peer_id not in node.discovery.known
    # The refusing peer does not count it as a member, and drops its connection.
    assert other.discovery.is_stray(node.peer_id)
    assert node.peer_id not in other.connected_peers()
    await wait_until(lambda: node.peer_id not in other._connected, 10, what="stray dropped")
