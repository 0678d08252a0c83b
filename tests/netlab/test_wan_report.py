"""benchmarks/wan.py's reporting (no lab needed): the swarm and scaling sections say what a
run missed instead of hiding it, and a section's load is sampled while it runs."""

from __future__ import annotations

from benchmarks.wan import LoadSampler, headlines, parse, swarm_body
from tests.waiting import wait_until


def swarm_out(first_accepted: dict) -> dict:
    usage = {"cone": [{"connections": 8, "rss_mib": 490.0, "cpu_per_s": 0.04}]}
    return {"nodes": 10, "all_started_s": 65.6, "first_accepted_s": first_accepted,
            "accepted_after_running_s": {k: [None if t is None else t - 30 for t in v]
                                         for k, v in first_accepted.items()},
            "steady": {"seconds": 60.0, "usage": usage, "versions": 3,
                       "connected_pairs": {"cone/cone": [2, 1, 3]},
                       "reachable": {"cone": [3, 3], "symmetric": [1, 2]}},
            "trainer": {"version": 9, "reward_first3": 0.01, "reward_last3": 0.12,
                        "rounds_lost": 0, "rollouts_accepted": 640},
            "log_signals": {}, "stage": {}}


def test_swarm_headline_counts_late_and_missing_peers_apart():
    args = parse(["--sections", "swarm", "--contribute-timeout", "300"])
    out = swarm_out({"cone": [40.0, 244.0, None], "symmetric": [None, 59.0],
                     "public": [10.0]})
    first, reach, direct = headlines("swarm", out, args)
    assert first.current.startswith("2/5 within 60 s, 1 later (max 244 s), 2 not within the "
                                    "300 s watch"), first.current
    assert "symmetric 50% (1/2)" in reach.current
    assert direct.current == "2/3 direct (67%)"


def test_swarm_body_renders_a_run_without_churn_or_partition():
    args = parse(["--sections", "swarm"])
    args.load_before = "1.00/1.00/1.00"
    body = swarm_body(args, swarm_out({"cone": [40.0, None]}))
    assert "| cone | 2 | 1 | 1 | 40 | 40 | 10 | 10 |" in body, body
    assert "reward first 3 versions 0.010, last 3 0.120" in body
    assert "Churn" not in body and "Partition" not in body


def test_scaling_headline_says_which_size_failed():
    args = parse(["--sections", "scaling"])
    out = {10: {"swarm": swarm_out({"cone": [40.0]})}, 40: {"failed": "NetlabError: x"}}
    (row,) = headlines("scaling", out, args)
    assert row.current == "N=10: peers 8.0 conns, 490 MiB, 0.04 CPU; N=40: failed"


def test_load_sampler_samples_while_a_section_runs():
    with LoadSampler(every=0.01) as loads:  # its own thread takes the samples
        wait_until(lambda: len(loads.samples) >= 3, 10, "two samples while running")
    assert len(loads.samples) >= 4  # one at the start, >= 2 while running, one at the end
    assert loads.summary().endswith(f"({len(loads.samples)} samples)")
