"""Reachability verdicts: the tracker's rules (unit), and the dial-back check on real hosts."""

from __future__ import annotations

from swarm_node.node.p2p.reachability import ReachabilityTracker, Verdict


def test_tracker_verdicts_and_listeners():
    tracker = ReachabilityTracker()
    seen: list[Verdict] = []
    unsubscribe = tracker.subscribe(lambda snap: seen.append(snap.verdict))
    assert tracker.current.verdict is Verdict.UNKNOWN and not tracker.current.public
    tracker.set_dialback(False, [], "1 of 1 dial-backs failed")
    assert tracker.current.verdict is Verdict.UNREACHABLE
    tracker.set_relay_addrs(["/ip4/1.2.3.4/tcp/4001/p2p/Qm/p2p-circuit/p2p/Qx"])
    assert tracker.current.verdict is Verdict.RELAYED
    tracker.set_direct_peers(1)
    assert tracker.current.verdict is Verdict.DIRECT
    tracker.set_direct_peers(2)  # same verdict: no call
    tracker.set_dialback(True, ["/ip4/1.2.3.4/tcp/4001"])
    assert tracker.current.public and tracker.current.public_addrs
    assert seen == [Verdict.UNREACHABLE, Verdict.RELAYED, Verdict.DIRECT, Verdict.PUBLIC]
    unsubscribe()
    tracker.set_dialback(False, [])
    assert len(seen) == 4
    assert "relay" in tracker.current.line() and tracker.current.as_dict()["verdict"] == "direct"
