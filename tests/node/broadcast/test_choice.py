"""Who a newcomer without --follow follows (issue 30.5, 29.1), with real libp2p hosts on
127.0.0.1: its bootstrap peers are asked whom they follow (FOLLOWS_PROTOCOL); it follows a
trainer only when they agree, learns the trainer of a relay it bootstraps through, and asks
the operator in one line when they disagree."""

from __future__ import annotations

import json
import logging

import pytest
from swarm_node.node.broadcast.follow import (
    FOLLOW_FILE,
    TrainerChoice,
    decode_follows,
    encode_follows,
)
from swarm_node.protocol.codec import pack

from .conftest import make_checkpoint, node_config, read_dir, until, wait_mesh


async def test_a_newcomer_bootstrapping_through_a_relay_follows_the_relays_trainer(
        tmp_path, swarm, caplog):
    ckpt = make_checkpoint(tmp_path / "ckpt", {"model.safetensors": 200_000})
    tnode, trainer = await swarm("trainer", "trainer")
    tid = tnode.peer_id
    rnode, _relay = await swarm("relay", "relay", follow=[tid], bootstrap=tnode.listen_addrs)
    choice = TrainerChoice(tmp_path / "new", [], [rnode.peer_id])
    with caplog.at_level(logging.DEBUG, logger="swarm_node.node.broadcast"):
        _nnode, new = await swarm("new", "inference", bootstrap=rnode.listen_addrs,
                                  choice=choice)
        await until(lambda: choice.chosen, what="the choice")
        await wait_mesh(rnode, "checkpoints", 2)
        await trainer.publish(ckpt, version=1)
        done = await new.done.wait(tid, 1)
    assert choice.chosen == tid and new.gate.follows(tid)
    assert read_dir(done.path) == read_dir(ckpt)
    assert json.loads((tmp_path / "new" / FOLLOW_FILE).read_text())["trainer"] == tid
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert not any("not_followed" in line for line in warned), warned


async def test_bootstrap_peers_that_disagree_leave_the_choice_to_the_operator(
        tmp_path, swarm, caplog):
    ckpt = make_checkpoint(tmp_path / "ckpt", {"model.safetensors": 100_000})
    tnode, trainer = await swarm("trainer", "trainer")
    anode, _attacker = await swarm("attacker", "trainer", bootstrap=tnode.listen_addrs)
    choice = TrainerChoice(tmp_path / "new", [], [tnode.peer_id, anode.peer_id])
    with caplog.at_level(logging.WARNING, logger="swarm_node.node.broadcast"):
        _nnode, new = await swarm("new", "inference",
                                  bootstrap=tnode.listen_addrs + anode.listen_addrs,
                                  choice=choice)
        await until(lambda: choice.problem, what="the disagreement")
        await wait_mesh(tnode, "checkpoints", 2)
        await trainer.publish(ckpt, version=1)
        await until(lambda: new.gate.rejected.get("not_followed"), what="a refused manifest")
    assert choice.chosen is None and not new.gate.follow and not new.store.entries
    assert not (tmp_path / "new" / FOLLOW_FILE).exists()
    told = [r.getMessage() for r in caplog.records if "disagree" in r.getMessage()]
    assert len(told) == 1  # one line, however often the peers are asked again
    assert tnode.peer_id in told[0] and anode.peer_id in told[0] and "--follow" in told[0]


async def test_bootstrap_peers_that_agree_are_followed(tmp_path, swarm):
    tnode, _trainer = await swarm("trainer", "trainer")
    rnode, _relay = await swarm("relay", "relay", follow=[tnode.peer_id],
                                bootstrap=tnode.listen_addrs)
    choice = TrainerChoice(tmp_path / "new", [], [tnode.peer_id, rnode.peer_id])
    await swarm("new", "relay", bootstrap=tnode.listen_addrs + rnode.listen_addrs,
                choice=choice)
    await until(lambda: choice.chosen, what="the choice")
    assert choice.chosen == tnode.peer_id and choice.problem is None


async def test_a_silent_bootstrap_peer_is_not_outvoted(tmp_path, swarm, monkeypatch, caplog):
    """Bootstrap [trainer, attacker] with the real trainer silent when the wait is over: the
    attacker's "follow me" is not followed; one line says who named whom and who is silent;
    once the trainer answers, they disagree, and still nothing is followed."""
    from swarm_node.node.broadcast import follow
    from swarm_node.node.broadcast.service import Broadcaster
    from swarm_node.node.identity import Identity
    from swarm_node.node.p2p import P2PNode

    monkeypatch.setattr(follow, "DECIDE_AFTER_S", 0.5)
    cfg = node_config()
    tnode = P2PNode(Identity.generate(), cfg)  # the trainer's host, not answering yet
    await tnode.start(bootstrap=[])
    trainer = Broadcaster(tnode, cfg.broadcast, tmp_path / "trainer", role="trainer",
                          interactive=False)
    try:
        anode, _attacker = await swarm("attacker", "trainer", bootstrap=tnode.listen_addrs)
        choice = TrainerChoice(tmp_path / "new", [], [tnode.peer_id, anode.peer_id])
        with caplog.at_level(logging.WARNING, logger="swarm_node.node.broadcast"):
            await swarm("new", "inference", bootstrap=tnode.listen_addrs + anode.listen_addrs,
                        choice=choice)
            line = await until(lambda: choice.problem, what="the silent peer named")
            assert choice.chosen is None and "--follow" in line
            assert f"{anode.peer_id} (named by {anode.peer_id[-8:]})" in line
            assert f"silent: {tnode.peer_id[-8:]}" in line
            await trainer.start()  # the trainer answers now: it names itself
            await until(lambda: "disagree" in (choice.problem or ""), 30, "the disagreement")
        assert choice.chosen is None and not (tmp_path / "new" / FOLLOW_FILE).exists()
        told = [r.getMessage() for r in caplog.records if "silent:" in r.getMessage()]
        assert len(told) == 1  # asked again and again, said once
    finally:
        await trainer.close()
        await tnode.close()


def test_choice_rules_without_a_network(tmp_path):
    c = TrainerChoice(tmp_path, [], ["boot1", "boot2"])
    c.answered("boot1", ["T"])
    assert c.decide() is None  # boot2 has not answered: wait
    c.answered("stranger", ["EVIL"])  # not a bootstrap peer: ignored
    c.answered("boot2", [])  # no choice of its own yet: no answer
    assert c.decide() is None and c.decide(final=True) == "T"
    c2 = TrainerChoice(tmp_path / "b", [], ["boot1", "boot2"])
    c2.answered("boot1", ["T"])
    c2.answered("boot2", ["T", "U"])  # a relay following two trainers: ambiguous
    assert c2.decide(final=True) is None and "U" in c2.problem
    # the only answer names T, the other bootstrap peer never answered: wait, however long
    c4 = TrainerChoice(tmp_path / "c", [], ["boot1", "boot2"])
    c4.answered("boot1", ["T"])
    assert c4.decide(final=True) is None and "silent: boot2" in c4.problem
    c4.answered("boot2", ["T"])
    assert c4.decide() == "T" and c4.problem is None
    # one bootstrap peer (the common case): its answer decides at once
    assert TrainerChoice(tmp_path / "d", [], ["boot1"]).decide(final=True) is None
    c5 = TrainerChoice(tmp_path / "d", [], ["boot1"])
    c5.answered("boot1", ["T"])
    assert c5.decide() == "T"
    # configured --follow wins over everything, and is what restarts keep
    c3 = TrainerChoice(tmp_path, ["X"], ["boot1"])
    assert c3.chosen == "X" and not c3.deciding


@pytest.mark.parametrize("data", [b"", b"\x91\x01", b"\xc0", pack(["a/b"]), pack({"a": 1}),
                                  pack([f"p{i}" for i in range(17)]),
                                  encode_follows(["T"])[:-1]])
def test_a_bad_follows_answer_is_refused(data):
    with pytest.raises(ValueError):
        decode_follows(data)
    assert decode_follows(encode_follows(["U", "T"])) == ["T", "U"]
