"""Scenarios of issue #27 with real `swarm-node join` processes inside the simulated internet.

NAT pair: a public trainer and relay, inference peers behind their own home NATs (two cone,
one symmetric) on 30-100 ms paths with ~1% loss. Every peer contributes accepted rollouts
(how soon, against the 60 s goal: benchmarks/wan.py) and hot-loads the versions as they
come; the two cone peers end up directly connected (DCUtR hole punch), the symmetric one
reaches the others only through the relay.

Every node is a real `swarm-node join` process forked warm into its host's namespace
(tests/launch.py; ~0.5 s of CPU to start instead of ~9 s; `SWARM_TEST_EXEC=1` execs them
through `ip netns exec` as benchmarks/wan.py does).
"""

from __future__ import annotations

import time

import pytest
from swarm_node.node.testing.netlab import Lab
from swarm_node.node.testing.netlab.scenarios import pair_topology, run_pair, wan_plan
from swarm_node.node.testing.netlab.swarm import LabSwarm, accepted_from

from tests.launch import start_join_in

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

# The trainer steps every 3 s on what arrived meanwhile (peer_batches_per_step far above what
# arrives, peer_wait_s 3), not on each peer batch: paced by each batch (the lab's default, as in
# benchmarks/wan.py, which keeps it), the trainer and the peers step as fast as the batches go
# round, and every version is broadcast through the user-space delay stage. Nothing here needs
# versions faster than one every few seconds (3.3-7.6 s per version measured, under load).
PACE = {"trainer": {"peer_batches_per_step": 1000, "peer_wait_s": 3.0}}
# The NAT pair's goal waits on links, not versions: the relayed links between the NAT'd peers
# and the hole punch came 68-140 s after the start (the goal needs v2; the trainer was at
# v17-37 by then, each version sent through the delay stage to four nodes). A step every 6 s:
# alone under the lock, 95.0 -> 72.7 and 70.2 s CPU, the links as soon (goal 67.7 -> 68.2,
# 67.9 s). A discovery_interval_s of 1 s did not bring the links sooner (75.5, 139.7 s): the
# discovery rounds waited 20-30 s on a DHT lookup and 10 s on dials of private addresses, and
# DCUtR 10 s on a direct dial, before each step (node/p2p/discovery.py, patches/dcutr.py). With
# those gone (2026-12-03, one run each, load 2-3): relayed links 1-2 s after the relay slots
# (were 17-52 s), the hole punch 6 s after (was 29 s); this test's call 80.1, 82.7 -> 27.3,
# 28.6 s (two runs each).
PAIR_PACE = {"trainer": {"peer_batches_per_step": 1000, "peer_wait_s": 6.0}}


def test_natted_peers_contribute_hot_load_and_connect_as_their_nats_allow(
        netlab_ok, tmp_path, tiny_model_dir):
    with Lab(pair_topology("cone", "cone", "symmetric"), prefix="netscen") as lab:
        obs = run_pair(lab, tmp_path, tiny_model_dir, versions=2, timeout=300,
                       settings=PAIR_PACE, launch=start_join_in)
    assert obs["goal_s"] is not None, obs
    # Every pair was connected as its NATs allow (`links_s`: when first seen so). The two
    # cone peers, once hole-punched, stay direct; a pair with the symmetric peer is never
    # direct. A relayed pair is not required to be connected at the last snapshot: relayed
    # connections between NAT'd peers end mid-run inside py-libp2p's transport (the yamux
    # session over the circuit ends, or the symmetric peer's own connection to the relay
    # and every circuit with it; seen in 3 of 8 runs on the lossy lab paths under load 7-9,
    # some pairs every 20-40 s) and the peers redial them, back within 1-25 s (the
    # `link_history` of those runs); one snapshot fell in such a gap.
    assert set(obs["links_s"]) == {"peer1-peer2", "peer1-peer3", "peer2-peer3"}, obs
    history = obs["link_history"]
    kinds = [kind for _, kind in history["peer1-peer2"]]
    assert "direct" in kinds and set(kinds[kinds.index("direct"):]) == {"direct"}, history
    for pair in ("peer1-peer3", "peer2-peer3"):
        assert "direct" not in {kind for _, kind in history[pair]}, history
    for peer in ("peer1", "peer2", "peer3"):
        assert obs[peer]["accepted"] > 0, obs  # (how soon: benchmarks/wan.py, goal 60 s)
        assert obs[peer]["policy_version"] >= 2, obs
        loaded = obs[peer]["versions_loaded"]
        # hot-loaded as they came (a peer that joins after v1 starts from the newest; a
        # version superseded while it downloaded is skipped, so run_pair waits for two)
        assert len(loaded) >= 2 and obs[peer]["policy_version"] in loaded, obs
    assert obs["peer3"]["reachability"] == "relayed", obs
    assert obs["stage"]["lost"] > 0  # the loss was really applied on the way
    assert set(obs["exit_codes"].values()) == {0}, obs


def test_churn_then_a_partition_that_heals(netlab_ok, tmp_path, tiny_model_dir):
    """One small swarm (a public trainer and relay, four peers: one public, two behind
    symmetric NATs, one behind a cone NAT; 20-200 ms paths, ~2% loss per path; a public
    spare) lives through both scenarios. Churn: a quarter of the peers (a symmetric one) is
    killed (its adverts stay behind) and a new one joins on the spare; the trainer loses no
    round, the newcomer contributes, downloads do not stall on the departed source.
    Partition: trainer, relay, the other symmetric peer and the newcomer | the public and
    the cone peer; the trainer's half keeps training (two versions); after the heal every
    peer is on the trainer's lineage again and the cut-off half contributes again."""
    # 4 peers, not 5 (a second cone peer in the trainer's half), and two versions in the
    # partition, not three: alone under the lock 96 -> 77 s CPU, 83 -> 64 s (load ~2)
    plan = wan_plan(6, seed=3, relays=1, spare=1)
    with Lab(plan.topology, prefix="netscen", seed=3) as lab, \
            LabSwarm(lab, tmp_path, tiny_model_dir, settings=PACE, launch=start_join_in) as sw:
        trainer = sw.start("trainer", plan.trainer, "trainer")
        sw.wait_started(trainer)
        relay = sw.start("relay", plan.relays[0], "relay", bootstrap=[trainer], follow=[trainer])
        sw.wait_started(relay)
        peers = [sw.start(h, h, "inference", bootstrap=[trainer, relay], follow=[trainer])
                 for h in plan.peers]
        sw.wait_started(*peers)
        sw.wait_until(lambda: all(accepted_from(trainer, p) for p in peers), 180,
                      "every peer contributing", every=2.0)

        # churn: the first NAT'd peer crashes (SIGKILL), a new one joins on the spare host
        gone = next(p for p in peers if plan.nat_of(p.host) != "public")
        v_churn = trainer.status["policy_version"]
        sw.stop(gone, kill=True)
        t_churn = time.time()
        new = sw.start(plan.spare[0], plan.spare[0], "inference", bootstrap=[trainer, relay],
                       follow=[trainer])
        sw.wait_started(new)
        stayed = [p for p in peers if p is not gone]
        accepted0 = {p.name: accepted_from(trainer, p) for p in stayed}
        sw.wait_until(lambda: accepted_from(trainer, new) > 0
                      and all(accepted_from(trainer, p) > accepted0[p.name] for p in stayed)
                      and all(p.status.get("policy_version", 0) >= v_churn + 2
                              for p in (*stayed, new)), 180, "work goes on after the churn",
                      every=2.0)
        versions = [v for v, _ in trainer.status["reward_history"]]
        assert versions == list(range(versions[0], versions[-1] + 1))  # no round lost
        # every peer downloaded versions published after the crash (adverts of the dead
        # peer may still be around; the wait above bounds how long the downloads took)
        assert all(any(d["t"] >= t_churn for d in p.status["downloads"]) for p in (*stayed, new))

        # a partition: trainer, relay and three peers | a public and a NAT'd peer
        peers = [*stayed, new]
        half_b = [next(p for p in peers if plan.nat_of(p.host) == "public"),
                  next(p for p in reversed(peers) if plan.nat_of(p.host) == "cone")]
        half_a = [p for p in peers if p not in half_b]
        lab.partition([trainer.host, relay.host, *(p.host for p in half_a)],
                      [p.host for p in half_b])
        sw.poll()
        v_cut = trainer.status["policy_version"]
        accepted_a = {p.name: accepted_from(trainer, p) for p in half_a}
        # the trainer's half trains on; the other half (no trainer: its rounds are bound to
        # the last version it has) waits, connected within itself
        sw.wait_until(lambda: trainer.status["policy_version"] >= v_cut + 2
                      and all(accepted_from(trainer, p) > accepted_a[p.name] for p in half_a)
                      and half_b[0].peer_id in half_b[1].status.get("peers", []), 120,
                      "the trainer's half working, the other half connected", every=2.0)
        lab.heal()
        sw.poll()
        v_heal = trainer.status["policy_version"]
        accepted_b = {p.name: accepted_from(trainer, p) for p in half_b}
        sw.wait_until(lambda: all(p.status.get("policy_id") == trainer.peer_id
                                  and p.status.get("policy_version", 0) >= v_heal + 1
                                  for p in peers)
                      and all(accepted_from(trainer, p) > accepted_b[p.name] for p in half_b),
                      180, "one lineage after the heal, the cut-off half contributing again",
                      every=2.0)
        codes = sw.stop_all()
    assert {k: v for k, v in codes.items() if k != gone.name} == dict.fromkeys(
        [trainer.name, relay.name, *(p.name for p in peers)], 0), codes
