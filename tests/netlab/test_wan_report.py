"""benchmarks/wan.py's reporting (no lab needed): the swarm and scaling sections say what a
run missed instead of hiding it, and a section's load is sampled while it runs."""

from __future__ import annotations

import os
import time

from swarm_node.node.testing.netlab.scenarios import wan_plan

from benchmarks.wan import (
    HOP_STAGES,
    LoadSampler,
    delivery_paths,
    headlines,
    hop_split,
    machine_line,
    parse,
    peer_timeline,
    receiver_timelines,
    scaling_interval,
    scaling_p2p_body,
    swarm_body,
    unconnected_line,
    unconnected_pairs,
    worker_usage,
)
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
            "log_signals": {}, "stage": {}, "boot_busy": 0.947,
            "boot_cpu_s": {"p1g1": [12.1, 17.0], "p2g2": [11.5, None], "p3g3": [None, None]}}


def test_swarm_headline_counts_late_and_missing_peers_apart():
    args = parse(["--sections", "swarm", "--contribute-timeout", "300"])
    out = swarm_out({"cone": [40.0, 244.0, None], "symmetric": [None, 59.0],
                     "public": [10.0]})
    first, reach, direct = headlines("swarm", out, args)
    assert first.current.startswith("2/5 within 60 s, 1 later (max 244 s), 2 not within the "
                                    "300 s watch"), first.current
    assert "symmetric 50% (1/2)" in reach.current
    assert direct.current == "2/3 direct (67%)"


def status(pid: str, peers: list[str], relayed: list[str] = (), knows: dict | None = None) -> dict:
    return {"peer_id": pid, "peers": list(peers), "connected_peers": len(peers),
            "p2p": {"connections": {"open": len(peers), "target": 3,
                                    "relayed_peers": list(relayed)},
                    "peer_reach": knows or {}}}


def test_unconnected_pairs_tell_a_full_connection_bound_from_a_failure():
    # a, b hold target_peers (3) each without each other: neither dials (by design); c holds
    # 2, below it, and is connected to neither a nor b... a failure
    peers = [("a", "cone", status("A", ["T", "R", "X"], knows={"B": ["relayed", "relay"]})),
             ("b", "cone", status("B", ["T", "R", "Y"])),
             ("c", "symmetric", status("C", ["T", "R"]))]
    seen = {("a", "b"): {"none"}, ("a", "c"): {"none", "relayed"}, ("b", "c"): {"none"}}
    out = unconnected_pairs(peers, seen)
    cone = out["cone/cone"]
    assert (cone["full"], cone["short"], cone["was"]) == (1, 0, 0)
    assert cone["detail"][0]["sides"] == [
        {"open": 3, "target": 3, "knows": ["relayed", "relay"]},
        {"open": 3, "target": 3, "knows": None}]
    mixed = out["cone/symmetric"]
    assert (mixed["full"], mixed["short"], mixed["was"]) == (0, 2, 1)
    line = unconnected_line(out)
    assert "cone/cone 1/0/0, cone/symmetric 0/2/1." in line, line


def test_the_cone_headline_counts_unconnected_pairs_by_why():
    args = parse(["--sections", "swarm"])
    out = swarm_out({"cone": [40.0]})
    out["steady"]["connected_pairs"] = {"cone/cone": [2, 0, 3]}
    out["steady"]["unconnected_pairs"] = {"cone/cone": {"full": 1, "short": 0, "was": 0,
                                                        "detail": []}}
    direct = headlines("swarm", out, args)[2]
    assert direct.current == ("2/2 direct (100%); 1 unconnected (1 both at target_peers, "
                              "0 short)"), direct.current


def test_swarm_body_renders_a_run_without_churn_or_partition():
    args = parse(["--sections", "swarm"])
    args.load_before = "1.00/1.00/1.00"
    body = swarm_body(args, swarm_out({"cone": [40.0, None]}))
    assert "| cone | 2 | 1 | 1 | 40 | 40 | 10 | 10 |" in body, body
    assert "exited during the start" not in body
    assert "reward first 3 versions 0.010, last 3 0.120" in body
    assert "Churn" not in body and "Partition" not in body
    assert "Pairs direct at some poll of the window (every 5 s) and not at its end: none" in body
    assert ("The cores were 95% busy from the trainer's start to the end of the contribute "
            "wait; a boot peer's own CPU until 'running': p50 11.5 s of CPU") in body, body


def test_swarm_body_says_how_the_boot_peers_were_launched():
    for gap, says in (("0", "every inference peer at once (launched 3.0-3.1 s"),
                      ("running", "each as soon as the one before it said 'running'"),
                      ("20", "each 20 s after the one before it (launched 3.0-3.1 s")):
        args = parse(["--sections", "swarm", "--launch-gap", gap])
        args.load_before = "1.00/1.00/1.00"
        out = swarm_out({"cone": [40.0]})
        out["launched_s"] = {"p1g1": 3.0, "p2g2": 3.1}
        out["steady"]["busy"] = 0.81
        body = swarm_body(args, out)
        assert says in body, body
        assert "the machine's cores 81% busy" in body, body


def test_swarm_body_names_peers_that_exited_during_the_start():
    args = parse(["--sections", "swarm"])
    args.load_before = "1.00/1.00/1.00"
    out = swarm_out({"cone": [40.0, None]})
    out["exited"] = ["lab node p4g3 exited with 1; its log:"]
    body = swarm_body(args, out)
    assert "Peers that exited during the start: ['lab node p4g3 exited with 1" in body, body


def test_scaling_headline_says_which_size_failed():
    args = parse(["--sections", "scaling"])
    out = {10: {"swarm": swarm_out({"cone": [40.0]})}, 40: {"failed": "NetlabError: x"}}
    (row,) = headlines("scaling", out, args)
    assert row.current == "N=10: peers 8.0 conns, 490 MiB, 0.04 CPU; N=40: failed"


def p2p_scaling_out(plan) -> dict:
    hosts = [plan.trainer, *plan.relays, *plan.peers]
    # each worker's done event: its links at the end (one relayed), mesh, CPU, batches got
    results = [{"host": h, "links": {"a": "direct", "b": "relayed", "c": "direct"},
                "mesh": ["a", "c"], "cpu_rounds_s": 0.9, "records": [[]] * 90}
               for h in hosts]
    u0 = [{"rss_mib": 100.0, "cpu_s": 1.0}] * len(hosts)
    u1 = [{"rss_mib": 150.0 + i, "cpu_s": 3.0} for i in range(len(hosts))]
    usage = worker_usage(results, plan, u0, u1, window=20.0)
    g = {"usage": usage, "interval": 4.5, "rounds": 10, "rounds_complete": 10, "ratio": 1.0,
         "round_p50": 0.9, "round_p95": 1.2, "lat_p95": 0.7, "pull_failed": 0, "busy": 0.4,
         "load": "min 1.0 / mean 2.0 / max 3.0 (3 samples)"}
    return {len(hosts): {"gossip": g}, 40: {"failed": "NetlabError: out of memory"}}


def test_p2p_scaling_reports_each_kind_of_worker_and_the_size_that_failed():
    args = parse(["--sections", "scaling", "--scaling-layer", "p2p", "--scaling", "10", "40",
                  "--scaling-interval-per-peer", "0.5"])
    args.load_before = "1.00/1.00/1.00"
    assert (scaling_interval(args, 10), scaling_interval(args, 40)) == (4.5, 19.5)
    plan = wan_plan(10)
    out = p2p_scaling_out(plan)
    usage = out[10]["gossip"]["usage"]
    assert sorted(usage) == ["cone", "public", "relay", "symmetric", "trainer"]
    assert len(usage["trainer"]) == 1 and len(usage["relay"]) == 2
    w = usage["trainer"][0]
    assert (w["connections"], w["relayed"], w["mesh"]) == (3, 1, 2)
    assert (w["rss_mib"], w["cpu_per_s"], w["cpu_ms_per_delivery"]) == (150.0, 0.1, 10.0)
    body = scaling_p2p_body(args, out)
    assert "interval 0.5 s per other node" in body
    assert "| 10 | trainer | 1 | 3.0 (3-3) | 1 | 2 |" in body, body
    assert "| 40 | failed | NetlabError: out of memory |" in body
    (row,) = headlines("scaling", out, args)
    assert row.current.startswith("p2p layer (gossip workers, no model): N=10: peers 3.0 "
                                  "conns (max 3), ")
    assert row.current.endswith("hubs 3-3 conns; ratio 1.000; N=40: failed"), row.current


def test_load_sampler_samples_while_a_section_runs():
    with LoadSampler(every=0.01) as loads:  # its own thread takes the samples
        wait_until(lambda: len(loads.samples) >= 3, 10, "two samples while running")
    assert len(loads.samples) >= 4  # one at the start, >= 2 while running, one at the end
    assert loads.summary().endswith(f"({len(loads.samples)} samples)")


def test_broadcast_timelines_say_when_each_receiver_had_a_transfer_in_flight():
    plan = wan_plan(4)  # trainer, relay1, relay2, p1
    ids = {"T": "trainer", "R1": "relay1", "R2": "relay2", "P1": "p1"}
    traces = {  # (start, end, version, shard, peer, outcome), wall clock; t0 = 100
        "trainer": [(100.0, 101.0, 1, 0, "P1", "sent"), (100.5, 100.5, 1, 1, "P1", "seeded"),
                    (100.0, 102.0, 1, 1, "R1", "sent")],
        "relay1": [(102.0, 103.0, 1, 1, "P1", "sent"), (104.0, 106.0, 1, 0, "R1", "cut")],
        "relay2": [], "p1": [(103.0, 104.0, 1, 0, "R2", "sent")]}
    tl = receiver_timelines(traces, ids, plan, {"p1": "public"}, 100.0,
                            {"p1": 4.0, "relay1": 3.0})
    p1 = tl["p1"]
    assert (p1["done"], p1["first_start"], p1["busy_s"], p1["idle_s"]) == (4.0, 0.0, 2.0, 2.0)
    assert p1["from"] == {"trainer": 1, "relay": 1} and p1["seeded"] == [0.5]
    assert tl["relay1"]["cut"] == 1 and tl["relay1"]["from"] == {"trainer": 1}
    assert tl["relay2"]["done"] is None and tl["relay2"]["shards"] == [(3.0, 4.0, 0, "p1", "sent")]
    machine = {"window_s": 10.0, "stage": {"bytes": 50e6, "cpu_s": 8.0, "packets": 1000,
                                           "late_10ms": 100}, "cpu_share": 0.9, "cores": 2}
    line = machine_line({"machine": machine, "timelines": tl})
    assert "carried 5.0 MB/s (50 MB in 10.0 s) on 80% of a core, 10% of its packets" in line
    assert "the stage used 90% of the 2 cores" in line
    assert "in flight 50%-67% of its download" in line, line  # p1 2 s of 4, relay1 2 of 3


def test_peer_timeline_reads_each_stage_from_the_first_log_line_that_says_it(tmp_path):
    lines = ["starting the libp2p host", "admin endpoint on http://127.0.0.1:1",
             "reachability: unreachable (3 of 3 dial-backs failed: timeout)",
             "reserved a relay slot on 12D3KooW", "inference peer ready: model m",
             "published round 4: 64 completions", "published round 5: 64 completions",
             "trainer x verified my round 4: 0 accepted, 64 rejected (first: queue_expired)",
             "trainer x verified my round 5: 64 accepted, 0 rejected"]
    launch = time.mktime((2026, 12, 3, 23, 17, 0, 0, 0, -1))
    stamp = lambda s: time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(launch + s))
    (tmp_path / "node.toml").write_text("")
    os.utime(tmp_path / "node.toml", (launch, launch))
    (tmp_path / "node.log").write_text("".join(
        f"{stamp(10 * i + 10)}.250 INFO    swarm_node: {text}\n" for i, text in enumerate(lines)))
    assert peer_timeline(tmp_path) == {"imports": 10.2, "host": 20.2, "verdict": 30.2,
                                       "relay slot": 40.2, "ready": 50.2, "published": 60.2,
                                       "accepted": 90.2}


def test_hop_split_cuts_each_announce_trip_into_stages_that_add_up_to_it():
    # O publishes seqno 7 (sealed at 9.99 s) and writes it to R; R validates it and writes
    # it on to S: one trip of one hop (R), one of two (S), each stage where the probes put it
    def worker(peer, **hops):
        base = {"read": {}, "task": {}, "valid": {}, "writes": {}, "published": [],
                "handled": [], "trio_lag": [0.0, 0.0, 0.0, 0.0]}
        return {"peer_id": peer, "links": {}, "hops": {**base, **hops}}

    results = [
        worker("O", published=[(10.0, 10.05, 7)], writes={"O/7": [("R", 10.02, 10.03)]}),
        worker("R", read={"O/7": (10.10, "O")}, task={"O/7": 10.12},
               valid={"O/7": (10.14, 10.15, "O", True, 9990)}, handled=[("O", 9990, 10.2)],
               writes={"O/7": [("S", 10.16, 10.17)]}),
        worker("S", read={"O/7": (10.25, "R")}, task={"O/7": 10.26},
               valid={"O/7": (10.27, 10.28, "R", True, 9990)}, handled=[("O", 9990, 10.3)]),
    ]
    out = hop_split(results, lambda a, b: 0.05)
    assert out["trips"] == 2 and out["missing"] == 0 and out["hops"] == {1: 1, 2: 1}
    assert abs(out["total"][2] - (0.21 + 0.31) / 2) < 1e-9
    parts = sum(out[name][2] for name in HOP_STAGES if name != "wire_excess")
    assert abs(parts - out["total"][2]) < 1e-9  # the stages add up to the trip
    assert abs(out["wire"][2] - (0.07 + 0.15) / 2) < 1e-9  # S: 0.07 + 0.08 over two hops
    assert abs(out["wire_excess"][2] - (0.02 + 0.05) / 2) < 1e-9
    assert abs(out["queue"][2] - (0.02 + 0.03) / 2) < 1e-9  # S: at O, then at R


def test_delivery_paths_name_how_each_rounds_slowest_delivery_came():
    # R got O's round 0 by push (0.3 s) and round 1 by pull (1.5 s); Q, not linked to O,
    # pulled both (0.8 s, 0.9 s): round 0's slowest is Q's pull, round 1's R's
    def trace(via, at):  # the worker's body trace: via, ..., origin, announced at, source
        return [via, 0.0, 0.0, 0.0, 0, False, False, False, "O", at, ""]

    results = [
        {"start": 100.0, "records": [["O", 0, 100.3, 0, 0], ["O", 1, 102.5, 0, 0]],
         "links": {"O": "direct"}, "traces": [trace("pull", 101.2), trace("push", 100.2)]},
        {"records": [["O", 0, 100.8, 0, 0], ["O", 1, 101.9, 0, 0]], "links": {},
         "traces": [trace("pull", 100.3), trace("pull", 101.3)]},
    ]
    out = delivery_paths(results, 1.0)
    assert {c: n for c, (n, _, _) in out["paths"].items()} == {
        "push/direct": 1, "pull/direct": 1, "pull/none": 2}
    assert out["worst"] == {"pull/none": 1, "pull/direct": 1}


def write_close_logs(path, extra: tuple[str, ...] = ()) -> None:
    """Two peers' node logs: a direct connection closed 0.3 s after it opened, on both
    sides, and py-libp2p lines around it (`extra`: more of p1g1's, before its close)."""
    ida, idb = "12D3KooWAAAA", "12D3KooWBBBB"
    day = "2026-12-05 06:51:"
    logs = {
        "trainer": [f"{day}00.000 INFO    swarm_node: peer id 12D3KooWTTTT",
                    f"{day}59.000 INFO    swarm_node: stopping"],
        "p1g1": [f"{day}00.000 INFO    swarm_node: peer id {ida}",
                 (f"{day}02.900 DEBUG   libp2p.relay.circuit_v2.dcutr: Connection "
                  f"established to {idb} at /ip4/10.0.0.2/tcp/4001"),
                 f"{day}02.950 DEBUG   libp2p.network.swarm: dialing 12D3KooWCCCC",
                 *(f"{day}02.960 {line}".replace("PEER", idb) for line in extra),
                 (f"{day}03.000 DEBUG   swarm_node.node.p2p.relay: connection to {idb} "
                  "closed after 0.3 s: direct /ip4/10.0.0.2/tcp/4001, outbound; reads ended "
                  "(EOF)"),
                 f"{day}30.000 DEBUG   libp2p.network.swarm: much later {idb}"],
        "p2g2": [f"{day}00.000 INFO    swarm_node: peer id {idb}",
                 (f"{day}03.010 DEBUG   swarm_node.node.p2p.relay: connection to {ida} "
                  "closed after 0.3 s: direct /ip4/10.0.0.1/tcp/4001, inbound; writes ended "
                  "(closed)")],
    }
    for name, lines in logs.items():
        (path / name).mkdir()
        (path / name / "node.log").write_text("\n".join(lines) + "\n")


def test_swarm_logs_show_the_library_lines_around_an_unexplained_close(tmp_path, capsys):
    from benchmarks.swarm_logs import closes

    write_close_logs(tmp_path)
    tally = closes(tmp_path, {"nat_of": {"p1g1": "cone", "p2g2": "cone"}}, everyone=False)
    assert sum(tally.values()) == 1
    out = capsys.readouterr().out
    assert "p1g1-p2g2 (cone/cone, 0.3 s old): UNEXPLAINED" in out, out
    shown = [ln for ln in out.splitlines() if ln.startswith("    p1g1: ")]
    assert len(shown) == 1 and "dcutr: Connection established to 12D3KooWBBBB" in shown[0], out


def test_swarm_logs_name_the_hole_punch_that_closed_its_own_connection(tmp_path, capsys):
    # swarm10 s50 10:02:14: DCUtR cancelled its dials once the connection verified; the dial
    # that made it was still in add_conn's notify, whose cleanup closed it
    from benchmarks.swarm_logs import closes

    failed = ("WARNING libp2p.network.swarm: [ADDCONN_FAIL] add_conn failed for peer PEER: "
              "BaseExceptionGroup('Exceptions from Trio nursery', [Cancelled(source='explicit')])")
    write_close_logs(tmp_path, (failed,))
    closes(tmp_path, {"nat_of": {"p1g1": "cone", "p2g2": "cone"}}, everyone=False)
    out = capsys.readouterr().out
    assert ("p1g1-p2g2 (cone/cone, 0.3 s old): py-libp2p: hole punch cancelled its own dial "
            "in add_conn") in out, out
