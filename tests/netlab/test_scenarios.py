"""Scenarios of issue #27 with real `swarm-node join` processes inside the simulated internet.

Today's baseline (before relays and hole punching): two inference peers behind two home NATs
(one cone, one symmetric) dial out to a public trainer; both must contribute accepted rollouts
and hot-load the trainer's versions over those outbound connections, on 40-100 ms paths with
~1% loss. What they cannot do yet (reach each other, be reached) is recorded by
benchmarks/wan.py, not asserted here.
"""

from __future__ import annotations

import pytest
from swarm_node.node.testing.netlab import Lab
from swarm_node.node.testing.netlab.scenarios import pair_topology, run_pair

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_two_natted_peers_contribute_and_hot_load_through_outbound_connections(
        netlab_ok, tmp_path, tiny_model_dir):
    with Lab(pair_topology("cone", "symmetric"), prefix="wan") as lab:
        obs = run_pair(lab, tmp_path, tiny_model_dir, versions=2, timeout=300)
    assert obs["goal_s"] is not None, obs
    for peer in ("peer1", "peer2"):
        assert obs[peer]["accepted"] > 0, obs
        assert obs[peer]["policy_version"] >= 2, obs
    assert obs["trainer_version"] >= 2
    assert obs["stage"]["lost"] > 0  # the loss was really applied on the way
    assert obs["exit_codes"] == {"trainer": 0, "relay": 0, "peer1": 0, "peer2": 0}, obs
