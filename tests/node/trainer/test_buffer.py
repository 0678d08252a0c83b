"""The rollout buffer: durability across SIGKILL, claim/release/recover, dedupe."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

from swarm_node.node.trainer.buffer import CompletionRecord, RolloutBuffer, RolloutGroup


def group(i: int, source: str = "local", version: int = 0) -> RolloutGroup:
    return RolloutGroup(
        source=source,
        task={"dataset": "toy/x", "params": {}, "seed": 1, "index": i},
        prompt_ids=[1, 2, i],
        completions=[CompletionRecord([3, i], 1.0, [-0.5, -0.25], "eos", "a"),
                     CompletionRecord([4], 0.0, [-1.0], "length", "b")],
        policy_version=version,
    )


def test_roundtrip_and_dedupe(tmp_path):
    buf = RolloutBuffer(tmp_path / "b.sqlite")
    ids = buf.add([group(0), group(1, "external")])
    assert len(ids) == 2
    assert buf.add([group(0)]) == []  # same content: stored once
    assert buf.counters()["duplicates"] == 1
    got = buf.pending()
    assert [g.id for g in got] == ids
    g0 = got[0]
    assert g0.prompt_ids == [1, 2, 0] and g0.rewards == [1.0, 0.0]
    assert g0.completions[0].logprobs == [-0.5, -0.25]
    assert g0.completions[1].finish_reason == "length"
    assert [g.id for g in buf.pending("external")] == [ids[1]]
    buf.close()


def test_claim_release_recover(tmp_path):
    path = tmp_path / "b.sqlite"
    buf = RolloutBuffer(path)
    ids = buf.add([group(i) for i in range(6)])
    buf.claim(ids[:2], step=1)
    buf.claim(ids[2:4], step=2)
    buf.drop([ids[4]], "stale")
    assert buf.count() == 1 and buf.count(claimed=True) == 4
    buf.release_through(1)  # checkpoint 1 durable
    assert buf.count(claimed=True) == 2
    buf.close()
    # crash after step 2 trained but before checkpoint 2: its groups come back
    buf = RolloutBuffer(path)
    released, returned = buf.recover(checkpointed_step=1)
    assert (released, returned) == (0, 2)
    assert sorted(g.id for g in buf.pending()) == [ids[2], ids[3], ids[5]]
    buf.claim([ids[2]], step=2)
    # crash after checkpoint 2 but before release: its groups are not used again
    released, returned = buf.recover(checkpointed_step=2)
    assert (released, returned) == (1, 0)
    assert sorted(g.id for g in buf.pending()) == [ids[3], ids[5]]
    c = buf.counters()
    assert c["trained"] == 3 and c["dropped_stale"] == 1
    buf.close()


WRITER = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    from test_buffer import group
    from swarm_node.node.trainer.buffer import RolloutBuffer
    buf = RolloutBuffer({path!r})
    i = 0
    while True:
        buf.add([group(i)])
        print(i, flush=True)   # acknowledged only after add() returned
        i += 1
""")


def test_sigkill_loses_no_acknowledged_group(tmp_path):
    path = tmp_path / "b.sqlite"
    code = WRITER.format(tests=os.path.dirname(__file__), path=str(path))
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    acked = []
    try:
        for line in proc.stdout:
            acked.append(int(line))
            if len(acked) >= 40:
                break
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        proc.stdout.close()
    assert proc.returncode == -signal.SIGKILL
    buf = RolloutBuffer(path)
    stored = {g.task["index"] for g in buf.pending()}
    assert set(acked) <= stored
    # whatever else is there is a complete, decodable group written before the kill
    assert stored <= set(range(max(stored) + 1))
    buf.close()
