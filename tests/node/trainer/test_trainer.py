"""Trainer behaviour: staleness, zero-advantage filter, SAPO re-scoring, resume after SIGKILL."""

from __future__ import annotations

import json
import os
import signal
import textwrap

import pytest
import torch
from swarm_node.node import diskspace
from swarm_node.node.config import Config
from swarm_node.node.diskspace import DiskFull
from swarm_node.node.tasks import format_prompt, get_task
from swarm_node.node.trainer.trainer import Trainer
from swarm_node.protocol.messages import Completion, RolloutBatch, SamplingParams, TensorData

from tests.launch import PIPE, start_program

from .helpers import mixed_group, ref, right_and_wrong, samples


def make_config(**trainer) -> Config:
    base = {"local_items": 2, "external_items": 2, "max_staleness": 1}
    return Config.model_validate({"trainer": {**base, **trainer}, "model": {"device": "cpu"}})


@pytest.fixture
def trainer(tiny_model_dir, tmp_path):
    t = Trainer(make_config(), tiny_model_dir, tmp_path / "data", policy_id="me")
    yield t
    t.close()


def test_step_updates_weights_and_version(trainer):
    assert trainer.version == 0 and trainer.latest_checkpoint().version == 0
    before = {k: v.clone() for k, v in trainer.state_dict().items()}
    assert trainer.add_local(mixed_group(trainer.tokenizer, 0)) == 1
    stats = trainer.step()
    assert stats.trained and stats.version == 1 == trainer.version
    assert stats.groups_local == 1 and stats.completions == 4
    assert stats.mean_reward == pytest.approx(0.5)
    assert stats.tokens > 0 and stats.grad_norm > 0
    assert trainer.latest_checkpoint().version == 1
    changed = any(not torch.equal(before[k], v) for k, v in trainer.state_dict().items())
    assert changed
    # nothing left: the next step trains on nothing and keeps the version
    stats = trainer.step()
    assert not stats.trained and stats.version == 1


def test_a_step_whose_checkpoint_hit_a_full_disk_is_saved_not_trained_again(tiny_model_dir,
                                                                              tmp_path):
    """The checkpoint of a trained step fails (the disk is full: the role retries the step
    once space returns): the retry writes that version's checkpoint and trains nothing. It
    used to train again on the next groups and never write the failed version."""
    # one group a step: a second is there for a retry to train on
    trainer = Trainer(make_config(local_items=1), tiny_model_dir, tmp_path / "data")
    tok = trainer.tokenizer
    trainer.add_local(mixed_group(tok, 0))
    trainer.add_local(mixed_group(tok, 1))
    saved = diskspace.margin()
    diskspace.configure(2**62)  # every space check fails, as on a full disk
    try:
        with pytest.raises(DiskFull) as failed:
            trainer.step()
    finally:
        diskspace.configure(saved)
    assert failed.value.need > 0  # what the retry waits for (the checkpoint's estimate)
    assert trainer.version == 1 and trainer.latest_checkpoint().version == 0
    trained = {k: v.clone() for k, v in trainer.state_dict().items()}
    stats = trainer.step()  # the retry, space back
    assert stats.trained and stats.version == 1 == trainer.version
    assert stats.checkpoint and trainer.latest_checkpoint().version == 1
    assert stats.groups_local == 1 and stats.pending_local == 1
    assert all(torch.equal(trained[k], v) for k, v in trainer.state_dict().items())
    assert trainer.step().version == 2  # then training goes on as before
    trainer.close()


def test_zero_advantage_groups_are_filtered(trainer):
    r = ref(1)
    good, _bad = right_and_wrong(r)
    tok = trainer.tokenizer
    assert trainer.add_local(samples(tok, r, [good] * 4)) == 0      # all 1.0
    assert trainer.add_local(samples(tok, ref(2), ["x", "y"])) == 0  # all 0.0
    assert trainer.counters()["dropped_zero_advantage"] == 2
    stats = trainer.step()
    assert not stats.trained and stats.dropped_zero_advantage == 2
    assert trainer.version == 0
    # the mean reward of what arrived is still reported (zero-advantage groups included)
    assert stats.mean_reward_local_new == pytest.approx(4 / 6)


def test_stale_rollouts_are_dropped_and_counted(tiny_model_dir, tmp_path):
    t = Trainer(make_config(max_staleness=1, local_items=1), tiny_model_dir, tmp_path / "d")
    tok = t.tokenizer
    for i in range(3):
        t.add_local(mixed_group(tok, i, version=0))
    assert t.step().version == 1          # uses one v0 group (age 0)
    s = t.step()                          # v0 groups have age 1 <= 1: still used
    assert s.trained and s.dropped_stale == 0 and t.version == 2
    # the last v0 group is now 2 versions old: dropped, not trained on
    s = t.step()
    assert not s.trained and s.dropped_stale == 1 and t.version == 2
    # arriving already stale: counted, never stored
    assert t.add_local(mixed_group(tok, 9, version=0)) == 0
    assert t.add_local(mixed_group(tok, 10, version=1)) == 1
    c = t.counters()
    assert c["dropped_stale"] == 2
    t.close()


def _completion(tok, r, text, claimed):
    junk = TensorData.from_numpy(__import__("numpy").array([5, 6, 7], dtype="int32"))
    return Completion(task=r, prompt_ids=junk, completion_ids=junk,
                      logprobs=TensorData.from_numpy(__import__("numpy").zeros(3, "float32")),
                      finish_reason="eos", seed=1, claimed_reward=claimed, text=text)


def test_external_rescored_ignores_sender_reward(trainer):
    tok = trainer.tokenizer
    r = ref(3)
    good, bad = right_and_wrong(r)
    # the sender lies: it claims 1.0 for the wrong answer and 0.0 for the right one
    comps = [_completion(tok, r, bad, 1.0), _completion(tok, r, good, 0.0),
             _completion(tok, r, bad, 1.0), _completion(tok, r, good, 0.0)]
    batch = RolloutBatch(swarm_id="s", round=0, policy_id="other", policy_version=42,
                         sampling=SamplingParams(temperature=1.0), completions=comps)
    assert trainer.add_external(batch) == 1
    (g,) = trainer.buffer.pending("external")
    assert g.rewards == [0.0, 1.0, 0.0, 1.0]
    # re-tokenised under our tokenizer from the regenerated task and the text
    assert g.prompt_ids == format_prompt(tok, get_task(r))
    assert g.completions[1].completion_ids == \
        list(tok.encode(good, add_special_tokens=False)) + [tok.eos_token_id]
    assert all(c.logprobs is None for c in g.completions)  # recomputed at training time
    # a sender claiming perfect rewards for an all-wrong group gives no signal: filtered
    lies = [_completion(tok, ref(4), "x", 1.0) for _ in range(4)]
    assert trainer.add_external(RolloutBatch(
        swarm_id="s", round=0, policy_id="other", policy_version=1,
        sampling=SamplingParams(), completions=lies)) == 0
    stats = trainer.step()
    assert stats.trained and stats.groups_external == 1 and stats.groups_local == 0
    # behaviour logprobs recomputed under the current policy: ratio 1 on the first update
    assert stats.mean_ratio == pytest.approx(1.0, abs=1e-5)


def own_batch(tok, i: int, version: int = 0) -> RolloutBatch:
    """A verified batch of the trainer's own policy ("me"): one task, a right and a wrong
    completion, behaviour logprobs -1.5 (as the verifier hands them on), claimed reward 0."""
    import numpy as np

    r = ref(i)
    good, bad = right_and_wrong(r)
    prompt = np.array(format_prompt(tok, get_task(r)), dtype="int32")
    comps = []
    for text in (good, bad):
        ids = np.array(list(tok.encode(text, add_special_tokens=False)) + [tok.eos_token_id],
                       dtype="int32")
        comps.append(Completion(task=r, prompt_ids=TensorData.from_numpy(prompt),
                                completion_ids=TensorData.from_numpy(ids),
                                logprobs=TensorData.from_numpy(np.full(len(ids), -1.5, "float32")),
                                finish_reason="eos", seed=0, claimed_reward=0.0, text=text))
    return RolloutBatch(swarm_id="s", round=0, policy_id="me", policy_version=version,
                        sampling=SamplingParams(), completions=comps)


def test_own_policy_batch_counts_as_local(trainer):
    tok = trainer.tokenizer
    assert trainer.add_external(own_batch(tok, 5)) == 1
    (g,) = trainer.buffer.pending("local")
    assert g.rewards == [1.0, 0.0]  # our reward, not the claimed 0.0
    # verified behaviour logprobs of our own policy are kept, not recomputed
    assert g.completions[0].logprobs == [-1.5] * len(g.completions[0].completion_ids)
    assert g.policy_version == 0


def test_a_batch_accepted_through_the_queue_grace_is_trained_on(tiny_model_dir, tmp_path):
    """Issue 30: the intake judges a batch of our policy as of its arrival (`as_of`) and
    forgives up to verifier.queue_grace versions of waiting in its queue; the trainer used to
    drop such a batch at storing (policy lag > max_staleness), so the sender got credit and
    the swarm lost the data, silently. Now the wait is not staleness here either: the group
    ages from its lag at arrival (persisted), is trained on, and one that still goes stale
    is counted `dropped_stale_queued`."""
    cfg = make_config(max_staleness=1, local_items=1)
    t = Trainer(cfg, tiny_model_dir, tmp_path / "d", policy_id="me")
    tok = t.tokenizer
    for i in range(3):  # the trainer moves on to v3
        assert t.add_local(mixed_group(tok, 10 + i, version=i)) == 1 and t.step().trained
    # sampled at v0, arrived at v1 (lag 1: fresh), verified at v3 (2 versions of queue)
    assert t.add_external(own_batch(tok, 5, version=0), "newcomer", as_of=1) == 1
    (g,) = t.buffer.pending("local")
    assert (g.policy_version, g.received_version, g.queued, g.sender) == (0, 3, 2, "newcomer")
    s = t.step()
    assert s.trained and s.group_ids == [g.id] and s.dropped_stale == 0
    assert t.counters()["stored_queued"] == 1 and "dropped_stale" not in t.counters()
    # another one (v1, arrived at v2, verified at v4), outranked by a fresher peer group
    # (v4): it has the same window as a batch verified on arrival (one more step here),
    # then goes stale, counted; the wait survives a restart (the buffer's payload)
    assert t.add_external(own_batch(tok, 6, version=1), "newcomer", as_of=2) == 1
    assert t.add_external(own_batch(tok, 8, version=4), "other", as_of=4) == 1
    t.close()
    t = Trainer(cfg, tiny_model_dir, tmp_path / "d", policy_id="me")
    assert t.version == 4 and sorted(g.queued for g in t.buffer.pending("local")) == [0, 2]
    s = t.step()
    assert s.trained and s.dropped_stale == 0 and t.buffer.pending("local")[0].queued == 2
    s = t.step()  # v5: 5 - 1 - 2 = 2 > max_staleness
    assert not s.trained and s.dropped_stale == 1
    c = t.counters()
    assert (c["stored_queued"], c["dropped_stale"], c["dropped_stale_queued"]) == (2, 1, 1)
    # without `as_of` (no queue: the batch arrived now) its lag is all staleness
    assert t.add_external(own_batch(tok, 7, version=3), "newcomer") == 0
    assert t.counters()["dropped_stale"] == 2 and t.counters()["dropped_stale_queued"] == 1
    t.close()


def test_accepted_peer_groups_are_trained_on_not_crowded_out(tiny_model_dir, tmp_path):
    """Issue 30 leftover: in a running trainer the own sampler adds `local_items` fresh
    groups every round; a verified batch of our policy from a peer (the sender credited) is
    older than those (sampled at an earlier version), so the freshest-first pick never
    reached it: it waited, aged out and was dropped stale (`dropped_stale_queued` when it
    had waited in the verification queue) while the own groups were trained at once. Now
    the groups peers sent go first while they are within max_staleness (still I local)."""
    cfg = make_config(local_items=2, external_items=0, max_staleness=2)
    t = Trainer(cfg, tiny_model_dir, tmp_path / "d", policy_id="me")
    tok = t.tokenizer
    peer_ids: set[int] = set()
    trained: set[int] = set()
    for rnd in range(6):  # the role's loop: intake, own sampling, step
        v = t.version
        if v >= 2:  # a peer's batch: sampled at v-2, arrived at v-1, verified now (grace)
            assert t.add_external(own_batch(tok, 100 + rnd, version=v - 2), "peer",
                                  as_of=v - 1) == 1
            peer_ids |= {g.id for g in t.buffer.pending("local") if g.sender == "peer"}
        for k in range(2):
            assert t.add_local(mixed_group(tok, 10 * rnd + k, version=v)) == 1
        s = t.step()
        assert s.trained and s.groups_local == 2
        trained |= set(s.group_ids)
    assert len(peer_ids) == 4 and t.counters()["stored_queued"] == 4
    # every peer group was trained on while fresh; none went stale
    assert peer_ids <= trained and "dropped_stale_queued" not in t.counters()
    # what did not fit is the own sampler's surplus: round 2's spare group, counted stale
    assert t.counters()["dropped_stale"] == 1
    t.close()


CHILD = textwrap.dedent("""
    import sys, json
    sys.path.insert(0, {root!r})
    from tests.node.trainer.helpers import mixed_group
    from tests.node.trainer.test_trainer import make_config
    from swarm_node.node.trainer.trainer import Trainer
    t = Trainer(make_config(local_items=2, max_staleness=1000, checkpoint_every=2),
                {model!r}, {data!r})
    i = {start}
    while True:
        for _ in range(3):
            t.add_local(mixed_group(t.tokenizer, i))
            print(json.dumps({{"acked": i}}), flush=True)
            i += 1
        s = t.step()
        print(json.dumps({{"step": s.version, "ids": s.group_ids,
                           "ckpt": s.checkpoint is not None}}), flush=True)
""")


def _run_child(root, model, data, start, kill_after_step):
    script = data.parent / f"child_{start}.py"
    script.write_text(CHILD.format(root=root, model=str(model), data=str(data), start=start))
    # forked warm (tests/launch.py): torch, transformers and the trainer already imported
    proc = start_program(path=script, argv=[], stdout=PIPE)
    events = []
    try:
        for line in proc.stdout:
            events.append(json.loads(line))
            if events[-1].get("step", 0) >= kill_after_step:
                # kill it somewhere in the next round of adds (or later, if it is fast)
                events.append(json.loads(proc.stdout.readline()))
                break
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
        # whatever it printed before dying is still in the pipe: the complete record
        events += [json.loads(x) for x in proc.stdout.read().splitlines() if x.strip()]
        proc.stdout.close()
    assert proc.returncode == -signal.SIGKILL
    return events


@pytest.mark.slow
def test_resume_after_sigkill(tiny_model_dir, tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    data = tmp_path / "data"
    events = _run_child(root, tiny_model_dir, data, start=0, kill_after_step=5)
    acked = [e["acked"] for e in events if "acked" in e]
    steps = [e for e in events if "step" in e]
    last = steps[-1]["step"]
    last_ckpt = max([s["step"] for s in steps if s["ckpt"]], default=0)

    cfg = make_config(local_items=2, max_staleness=1000, checkpoint_every=2)
    t = Trainer(cfg, tiny_model_dir, data)
    # resumed at the newest durable checkpoint: the last one it reported, or the next one
    # if it died between writing a checkpoint and printing the step
    assert t.version == last_ckpt or (t.version == last + 1 and t.version % 2 == 0)
    unprinted = 2 if t.version == last + 1 else 0  # groups of a checkpointed, unprinted step
    assert t.version >= 4 and last >= 5
    pending = {g.task["index"]: g.id for g in t.buffer.pending("local")}
    used_kept = [i for s in steps if s["step"] <= t.version for i in s["ids"]]
    lost = {i for s in steps if s["step"] > t.version for i in s["ids"]}
    assert len(used_kept) == len(set(used_kept)) == 2 * t.version - unprinted
    # row ids are 1, 2, ... in add order and the child adds one group per ack: id = index + 1
    assert all(row == index + 1 for index, row in pending.items())
    # nothing acknowledged is lost: each acked group is pending or used by a kept step
    missing = [i for i in acked if i + 1 not in set(pending.values()) | set(used_kept)]
    assert len(missing) <= unprinted
    # groups of lost steps are back in the buffer; groups of kept steps are not (no reuse)
    assert lost <= set(pending.values())
    assert not set(used_kept) & set(pending.values())
    assert t.counters()["trained"] == len(used_kept) + unprinted
    # training continues from there and uses only pending groups
    s = t.step()
    assert s.trained and s.version == t.version
    assert set(s.group_ids) <= set(pending.values())
    t.close()
