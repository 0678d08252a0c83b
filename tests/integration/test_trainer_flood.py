"""Verification load from fresh keys does not stop training (issue 30 findings 4 and 11):
real `swarm-node join` processes (a trainer and an established honest inference peer, tiny
model) and, in this test process, a sybil flood (node/testing/flood.py): batches that pass
every check before the model runs, each signed by a fresh key that also accuses the honest
peer with a reject verdict, over 4 connections that are replaced when cut. Asserted as
counts from the nodes themselves: every honest batch is accepted during and after the
flood, the flood's verification time stays within the probation time share the trainer
reports, the queue and memory stay bounded, and the honest peer's acceptance rate per CPU
second returns after it. Throughput figures (honest share during the flood, recovery
time, attacker vs trainer cost): benchmarks/verifier_flood.py."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time

import pytest

from .pacing import PACE
from .test_operator import Node, trainer_config
from .test_trainer_restart import until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

SHARE, BURST_S = 0.1, 0.5  # IntakeLimits defaults: probation_time_share, probation_burst_s


def rss_mib(pid: int) -> float:
    from pathlib import Path

    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far."""
    import os
    from pathlib import Path

    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def flood_kit(cfg_dict: dict, tiny_model_dir, target: str):
    """(Config, make_batch) of a flood against the swarm of `cfg_dict`."""
    from swarm_node.node.config import Config
    from swarm_node.node.models import load_model
    from swarm_node.node.sampler.factory import sampling_params
    from swarm_node.node.tasks import TaskSource
    from swarm_node.node.testing import attacks
    from swarm_node.verifier.rules import batch_rules

    swarm = Config.model_validate({
        **{k: v for k, v in cfg_dict.items() if k in ("tasks", "sampler")},
        "node": {"swarm_id": cfg_dict["node"]["swarm_id"],
                 "listen": ["/ip4/127.0.0.1/tcp/0"]}})
    model, tokenizer = load_model(tiny_model_dir)
    source = TaskSource(swarm.tasks.mix, swarm.node.swarm_id)
    rules, params = batch_rules(swarm), sampling_params(swarm)
    hidden = model.config.hidden_size  # the proof's length depends on it
    rng = random.Random(0)

    def make_batch(sender: str, version: int):
        return attacks.bogus_round(tokenizer, source, sender, round_=rules.round_for(version, 0),
                                   version=version, tasks=rules.tasks_per_round,
                                   n=rules.completions_per_task, params=params,
                                   hidden_size=hidden, rng=rng, policy_id=target,
                                   swarm_id=swarm.node.swarm_id,
                                   length=params.max_new_tokens)
    return swarm, make_batch


def version_reader(trainer: Node):
    """A callable: the trainer's policy version, read again at most once a second."""
    seen = {"version": trainer.status()["policy_version"], "at": time.monotonic()}

    def version() -> int:
        if time.monotonic() - seen["at"] >= 1.0:
            seen.update(version=trainer.status().get("policy_version", seen["version"]),
                        at=time.monotonic())
        return seen["version"]
    return version


def trainer_address(trainer: Node) -> str:
    return json.loads((trainer.data / "node.json").read_text())["listen_addrs"][0]


@contextlib.asynccontextmanager
async def honest_pair(tmp_path, tiny_model_dir, dtype: str = "float32", **trainer):
    """A trainer (one peer batch per step, 8 new tokens, weights in `dtype`, `trainer`
    settings) and an honest inference peer that follows it, real processes, once the peer
    is established (32 completions accepted);
    yields (trainer, its config, honest(), the trainer's peer id, its address), honest()
    being the peer's counts at the trainer (and its id, "peer").
    Both stopped at the end."""
    tcfg = trainer_config(tmp_path / "t", tiny_model_dir, **{
        "peer_batches_per_step": 1, "peer_wait_s": 5.0, **trainer})
    tcfg["sampler"]["max_new_tokens"] = 8
    tcfg["model"]["dtype"] = dtype
    trainer = Node(tmp_path / "t", tcfg).start()
    peer = None
    try:
        info = trainer.wait_listening()  # the peer loads while the trainer does
        tid = info["peer_id"]
        peer = Node(tmp_path / "p", {
            "node": {"role": "inference", "swarm_id": tcfg["node"]["swarm_id"],
                     "data_dir": str(tmp_path / "p" / "data"), "listen": ["/ip4/127.0.0.1/tcp/0"],
                     "bootstrap": [info["listen_addrs"][0]], "follow": [tid]},
            "model": tcfg["model"], "admin": {"port": 0},
            "tasks": tcfg["tasks"], "sampler": {**tcfg["sampler"], "version_wait_s": 5.0},
        }).start()
        trainer.wait_joined()
        peer.wait_joined()
        hid = peer.status()["peer_id"]

        def honest() -> dict:
            return {"peer": hid, **(trainer.status().get("accepted_by_peer") or {}).get(
                hid, {"accepted": 0, "rejected": 0})}

        await until(lambda: honest()["accepted"] >= 32, 300, "the honest peer established",
                    trainer)
        yield trainer, tcfg, honest, tid, trainer_address(trainer)
    finally:
        if peer is not None:
            peer.stop()
        trainer.stop()


async def test_4_a_fresh_key_flood_costs_at_most_the_probation_share_and_the_rate_returns(
        tmp_path, tiny_model_dir):
    """Issue 30 items 4 and 11 and "Recovery", on one flood of fresh keys (4 connections),
    each key also accusing the honest peer: the flood's verification time stays within the
    probation share, the accusations change nothing, the queue and memory stay bounded,
    and afterwards the honest peer's acceptance rate gets back to >= 80% of its rate
    before the flood, without a restart.

    The rate asserted is per CPU second of the two honest processes (trainer and peer): on
    a shared 2-core machine their wall-clock rate follows whatever else runs (measured 122/s
    and 25/s in two runs minutes apart), their CPU rate follows only what they do; the
    wall-clock rates are printed beside it. Before: over 10 s of the trainer's clock before
    the flood; after: from the flood's end on, once that spans 5 s. How long the return took
    is printed (an upper bound that includes the window), never asserted; the ceiling only
    ends a hang. (The recovery had its own pair of processes and a 15 s flood without
    accusations: one pair and one flood now serve both.)"""
    from swarm_node.node.testing.flood import SybilFlood

    window = 5.0  # seconds of the trainer's clock per rate

    stop = asyncio.Event()
    flooding = None
    async with honest_pair(tmp_path, tiny_model_dir) as (trainer, tcfg, honest, tid, boot):
        try:
            def intake() -> dict:
                return (trainer.status().get("extra") or {}).get("intake") or {}

            peer_pid = json.loads((tmp_path / "p" / "data" / "node.json").read_text())["pid"]
            # (trainer uptime, honest accepted, CPU seconds of trainer + peer)
            samples: list[tuple[float, int, float]] = []

            def sample() -> tuple[float, int, float]:
                s = trainer.status()
                got = (s.get("accepted_by_peer") or {}).get(honest()["peer"], {})
                samples.append((s["uptime_s"], got.get("accepted", 0),
                                cpu_s(trainer.proc.pid) + cpu_s(peer_pid)))
                return samples[-1]

            def rates(since: float, until_: float = 1e18) -> tuple[float, float] | None:
                """(accepted per second, per CPU second) between the first sample at or
                after `since` and the last one before `until_`, once they span `window`."""
                first = next((x for x in samples if x[0] >= since), None)
                last = [x for x in samples if x[0] <= until_][-1]
                if first is None or last[0] - first[0] < window or last[2] <= first[2]:
                    return None
                return ((last[1] - first[1]) / (last[0] - first[0]),
                        (last[1] - first[1]) / (last[2] - first[2]))

            start = sample()[0]
            base = await until(lambda: sample()[0] - start >= 2 * window and rates(start),
                               300, "the honest rate before the flood", trainer)

            swarm, make_batch = flood_kit(tcfg, tiny_model_dir, tid)
            version = version_reader(trainer)
            # each fresh key also accuses the honest peer (item 11): it must stay established
            flood = SybilFlood(swarm, boot, tid, make_batch, version, connections=4,
                               interval_s=0.05, accuse=honest()["peer"])
            rss0, view0 = rss_mib(trainer.proc.pid), intake()
            t0, before = sample()[:2]
            flooding = asyncio.ensure_future(flood.run(stop))
            # the flood runs until the honest peer had 4 more batches (64 completions) accepted
            # and 20 s of the trainer's clock went by (long enough for the share, 2 s, not
            # the bucket's depth, 0.5 s, to bound what the flood gets)
            await until(lambda: (s := sample())[1] >= before + 64 and s[0] >= t0 + 20, 400,
                        "honest batches accepted during 20 s of flood", trainer)
            during, view1 = samples[-1][1] - before, intake()
            elapsed = samples[-1][0] - t0
            during_rates = rates(t0) or (0.0, 0.0)
            stop.set()
            await flooding
            flooding = None
            rss1 = rss_mib(trainer.proc.pid)
            t1 = sample()[0]
            back = await until(lambda: sample() and (rates(t1) or (0, 0))[1] >= 0.8 * base[1]
                               and samples[-1][0], 300,  # 120 s ran out once in a loaded
                               # fresh-clone run (the honest peer's rounds verified 16/0 all
                               # along: the other workers' load, not the trainer)
                               "the honest rate back to 80% of before", trainer)
            after = rates(t1)
            after0 = honest()["accepted"]
            await until(lambda: honest()["accepted"] >= after0 + 32, 300,
                        "honest batches accepted after the flood", trainer)

            spent = view1["verify_seconds"]["probation"] - view0["verify_seconds"]["probation"]
            lent = (view1["verify_seconds"]["probation_lent"]
                    - view0["verify_seconds"]["probation_lent"])
            verified = view1["batches"].get("probation", 0) - view0["batches"].get("probation", 0)
            print(f"flood: {flood.sent} bogus batches and {flood.accusations} verdicts against "
                  f"the honest peer over {flood.carriers} carriers ({flood.cut} "
                  f"cut), {verified} verified by the trainer in {spent:.1f} s of {elapsed:.0f} s "
                  f"(+ {lent:.1f} s of idle time lent); "
                  f"honest accepted during: {during}; dropped {view1['dropped']}; verdicts "
                  f"heard {view1.get('verdicts')}; attacker "
                  f"{flood.cpu_per_batch * 1e3:.1f} ms CPU per batch; trainer RSS {rss0:.0f} -> "
                  f"{rss1:.0f} MiB")
            print(f"recovery: honest rate before {base[0]:.1f}/s ({base[1]:.1f} per CPU-s), "
                  f"during the flood {during_rates[0]:.1f}/s ({during_rates[1]:.1f} per CPU-s), "
                  f"after {after[0]:.1f}/s ({after[1]:.1f} per CPU-s): >= 80% per CPU-s again "
                  f"{back - t1:.1f} s after the flood (window {window:.0f} s included)")
            # nothing of the honest peer lost or refused, but for a known rare case: one run of
            # the full suite in a fresh clone (2 busy workers) saw 8 of 7,160 honest completions
            # rejected, reason not captured then (printed now); not reproduced in 3 runs since.
            # The likely cause, reproduced apart and fixed (verifier/checks.py):
            # `eos_improbable`. 7,160 completions is ~450 versions, and this trainer (lr
            # 1e-3, toy task) drives p(EOS) at every position down (median 2e-3 at v0,
            # 1.2e-4 at v400, 8e-5 at v520); the EOS gate then rejected honestly sampled
            # EOS tokens with their groups of 4 (4 of 9,600 honest completions at v520).
            # It now applies only to an EOS that was not the seeded choice.
            print(f"honest peer at the trainer: {honest()}")
            assert honest()["rejected"] <= honest()["accepted"] // 500, honest()
            heard = view1.get("verdicts", {})  # the accusations reached the trainer ...
            assert heard.get("ignored", 0) - view0.get("verdicts", {}).get("ignored", 0) > 0
            assert heard.get("used", 0) == view0.get("verdicts", {}).get("used", 0)  # ... in vain
            assert verified > 0  # the flood did reach the model checks ...
            # ... within the probation share: its refill and its depth (plus the batch in
            # flight); what the trainer lent while it only waited for peers is counted apart
            assert spent <= SHARE * elapsed + BURST_S + 2.0
            assert view1["queued"] <= 16 + 256  # bounded (most of the flood is dropped even
            # before it: the gossip admission throttles whoever keeps bringing new keys)
            assert rss1 <= rss0 + 300
            assert trainer.proc.poll() is None
        finally:
            stop.set()
            if flooding is not None:
                await flooding


async def test_13_garbage_on_every_protocol_does_not_stop_training(tmp_path, tiny_model_dir):
    """Issue 30 item 13: random bytes on every protocol the trainer serves (ours and
    libp2p's: meshsub, identify, ping, kad), from 8 connections of fresh identities replaced
    when cut: the trainer keeps training on the established honest peer's batches during
    and after it, and rejects none of them; its memory stays bounded, and the honest
    peer's acceptance rate (per second of the trainer's clock) stays at half its rate
    before at least during the garbage and gets back to 80% of it after (the issue: 67/s
    to 9.6/s, measured at the p2p layer only). How long the return took is printed, never
    asserted; the ceiling only ends a hang."""
    from swarm_node.node.config import Config
    from swarm_node.node.testing.flood import GarbageFlood

    window = 10.0  # seconds of the trainer's clock per rate (3 paced versions at least)
    stop = asyncio.Event()
    flooding = None
    # paced (pacing.py): a step every 3 s, so the 4 versions waited for take ~15 s of
    # garbage (9 came in the 30 s it was: 1,531 streams; now 4-5 in 15-20 s, ~500-800
    # streams; a trainer that dies on an oversize request, broken by hand, fails it the
    # same); stepping per honest batch, the pair ran flat out beside the garbage.
    # Garbage is no batch: nothing of it is verified in the trainer's idle time
    async with honest_pair(tmp_path, tiny_model_dir, **PACE) as (trainer, tcfg, honest, tid,
                                                                 boot):
        try:
            samples: list[tuple[float, int]] = []  # (trainer uptime, honest accepted)

            def sample() -> tuple[float, int]:
                samples.append((trainer.status()["uptime_s"], honest()["accepted"]))
                return samples[-1]

            def rate(since: float) -> float | None:
                """Honest completions accepted per second from `since` on, once that
                spans `window`."""
                first = next((x for x in samples if x[0] >= since), None)
                if first is None or samples[-1][0] - first[0] < window:
                    return None
                return (samples[-1][1] - first[1]) / (samples[-1][0] - first[0])

            start = sample()[0]
            base = await until(lambda: sample() and rate(start), 300,
                               "the honest rate before the garbage", trainer)
            swarm = Config.model_validate({"node": {"swarm_id": tcfg["node"]["swarm_id"],
                                                    "listen": ["/ip4/127.0.0.1/tcp/0"]}})
            flood = GarbageFlood(swarm, boot, tid, connections=8, interval_s=0.1)
            rss0 = rss_mib(trainer.proc.pid)
            (t0, before), v0 = sample(), trainer.status()["policy_version"]
            flooding = asyncio.ensure_future(flood.run(stop))
            # 15 s of the trainer's clock with garbage at least, 4 more honest batches and 4
            # versions trained on meanwhile
            await until(lambda: (s := sample())[1] >= before + 64 and s[0] >= t0 + 15
                        and trainer.status().get("policy_version", 0) >= v0 + 4, 400,
                        "honest batches accepted and 4 versions during the garbage", trainer)
            during, v1 = rate(t0) or 0.0, trainer.status()["policy_version"]
            stop.set()
            await flooding
            flooding = None
            rss1 = rss_mib(trainer.proc.pid)
            t1 = sample()[0]
            back = await until(lambda: sample() and (rate(t1) or 0.0) >= 0.8 * base
                               and samples[-1][0], 300,
                               "the honest rate back to 80% of before", trainer)
            print(f"garbage: {flood.streams} streams over {flood.carriers} carriers "
                  f"({flood.cut} cut, {flood.refused} refused); versions {v0} -> {v1}; honest "
                  f"rate before {base:.1f}/s, during {during:.1f}/s, >= 80% again "
                  f"{back - t1:.1f} s after (window {window:.0f} s included); trainer RSS "
                  f"{rss0:.0f} -> {rss1:.0f} MiB")
            assert flood.streams >= 100  # the garbage did reach the trainer's handlers
            assert v1 >= v0 + 4 and honest()["rejected"] == 0
            assert during >= 0.5 * base
            assert rss1 <= rss0 + 300  # as test_4: bounded, whatever the garbage held
            assert trainer.proc.poll() is None
        finally:
            stop.set()
            if flooding is not None:
                await flooding
