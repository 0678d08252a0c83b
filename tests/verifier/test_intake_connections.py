"""The probation lane is fair per introducing connection and subnet, not per key (issue 30,
"Identity has a price"): fresh keys brought over one or a few connections share those
connections' turns, and a full queue evicts from the connection with the most queued, so an
honest newcomer on its own connection is served at the head of the next round and never
evicted for them. The real queue, and the real intake on test_intake's scripted verifier
and simulated clock."""

from __future__ import annotations

import itertools
import random
from types import SimpleNamespace

from swarm_node.verifier.intake import IntakeLimits, VerificationQueue

from .test_intake import HONEST, Clock, Scripted, batch, establish, make

LAN = "127.0.0.0/24"


def test_fresh_keys_over_two_connections_neither_evict_nor_delay_a_newcomer():
    """40 fresh keys over 2 carriers against a 16-slot queue: each eviction is a carrier's
    newest, the newcomer keeps its 4 batches, and its first is served in the first round
    (on the old per-key queue its batches were the heaviest sender's, evicted first, and
    its last one lost at random among the keys)."""
    for seed in range(20):
        q = VerificationQueue(lambda s: False, IntakeLimits(max_probation=16),
                              rng=random.Random(seed))
        keys = (f"sybil{k}" for k in itertools.count())
        for k in range(16):
            key = next(keys)
            q.put(key, key, (f"carrier{k % 2}", LAN))
        for r in range(4):  # a joiner's catch-up burst, on its own connection
            q.put("newcomer", ("newcomer", r), ("newcomer", LAN))
        for k in range(40):
            key = next(keys)
            q.put(key, key, (f"carrier{k % 2}", LAN))
        assert len(q) == 16 and q.dropped == {"probation_evicted": 44}
        assert q.flood_evictions == 44  # each a fresh key's only batch: the share falls
        order = [q.get()[0] for _ in range(3)]
        assert "newcomer" in order, order  # one turn per connection: carrier0, 1, newcomer
        rest = [q.get()[0] for _ in range(13)]
        assert order.count("newcomer") + rest.count("newcomer") == 4  # none evicted


def test_the_lane_takes_turns_per_subnet_then_connection_then_key():
    q = VerificationQueue(lambda s: False, IntakeLimits(max_probation=64))
    for c in range(4):  # one subnet, 4 connections, 3 keys each
        for k in range(3):
            q.put(f"s{c}-{k}", c, (f"conn{c}", "10.0.0.0/24"))
    q.put("other", "o", ("far", "192.0.2.0/24"))  # another subnet, one key
    q.put("other", "o2", ("far", "192.0.2.0/24"))
    served = [q.get() for _ in range(14)]
    assert [s for s, _ in served[:4]] == ["s0-0", "other", "s1-0", "other"]
    # within the subnet: its connections in turn, each connection's keys in turn
    assert [s for s, _ in served[4:8]] == ["s2-0", "s3-0", "s0-1", "s1-1"]
    assert q.get() is None


def test_a_quiet_connection_does_not_bank_turns():
    """A connection served often, then a new one: they alternate (the new one starts at the
    fewest turns of those waiting, not at 0), and it goes first in the round it joins."""
    q = VerificationQueue(lambda s: False, IntakeLimits(max_probation=64))
    for k in range(10):
        q.put(f"old{k}", k, ("old", LAN))
        q.get()
    for k in range(4):
        q.put(f"old{10 + k}", k, ("old", LAN))
        q.put(f"new{k}", k, ("new", LAN))
    assert [q.get()[0][:3] for _ in range(8)] == ["new", "old"] * 4


def test_a_full_queue_evicts_from_the_subnet_with_the_most_queued():
    q = VerificationQueue(lambda s: False, IntakeLimits(max_probation=8),
                          rng=random.Random(1))
    q.put("newcomer", "n", ("newcomer", "192.0.2.0/24"))
    for k in range(30):  # many connections of one subnet, one key each
        q.put(f"sybil{k}", k, (f"carrier{k}", "10.0.0.0/24"))
    assert len(q) == 8 and q.next_probation() == "newcomer"


async def offer(intake, sender: str, round_: int) -> None:
    await intake.offer(SimpleNamespace(sender=sender, message=batch(round_)), sender)


async def test_a_newcomer_is_accepted_in_a_fresh_key_flood_over_32_carriers(tmp_path):
    """The `verifier-flood-newcomer` B shape on a simulated clock: 100 bogus batches/s, each
    a fresh key introduced by one of 32 carrier connections (all one subnet, as on
    127.0.0.1), a trainer that never idles, an established peer, and a newcomer that joins
    with a catch-up burst of 4 batches and then offers one per second. Its first batch is
    verified and accepted within 2 s (its burst is trimmed to the connection's fair slice:
    its newest batches go, never its first), and the established peer loses nothing. On
    the old per-key queue its first batch was evicted as the heaviest sender's."""

    class Judge(Scripted):
        def verify(self, b, sender, spot_check=None, probe=False, as_of=None):
            self.reason = "proof_index_mismatch" if sender.startswith("sybil") else "ok"
            self.rounds.append((sender, b.round))
            return super().verify(b, sender, spot_check, probe, as_of)

    clock = Clock()
    v = Judge(clock, cost=0.01)
    v.rounds = []
    intake = make(tmp_path, v)
    establish(intake.reputation, HONEST)
    carrier = {}
    intake.introducer = lambda sender: (carrier.get(sender, sender), LAN)
    keys = itertools.count()

    async def flood_tick() -> None:  # 0.1 s of the flood: 10 fresh keys
        for _ in range(10):
            k = next(keys)
            carrier[f"sybil{k}"] = f"carrier{k % 32}"
            await offer(intake, f"sybil{k}", 1000 + k)

    joined, first_accepted, offered = None, None, 0
    for tick in range(200):  # 20 s; the trainer drains every 0.1 s
        await flood_tick()
        if tick % 10 == 0:
            await offer(intake, HONEST, tick)
        if tick == 80:
            joined = clock.t
            for r in range(4):
                await offer(intake, "newcomer", r)
            offered = 4
        elif tick > 80 and tick % 10 == 0 and offered < 8:
            await offer(intake, "newcomer", offered)
            offered += 1
        await intake.drain()
        clock.t += 0.1
        newcomer = intake.state.by_peer.get("newcomer")
        if first_accepted is None and newcomer is not None and newcomer.accepted:
            first_accepted = clock.t
    assert intake.queue.flood_evictions > 100  # the queue was full of fresh keys
    assert first_accepted is not None and first_accepted - joined <= 2.0, first_accepted
    newcomer = [r for s, r in v.rounds if s == "newcomer"]
    # then established: its second accepted batch makes it so (at a fixed floor its 5th
    # batch, [0, 4, 5, 6, 7]; with the flood's share below the floor before it joined, its
    # first is served later and its 5th or 6th: [0, 5, 6, 7] or [0, 6, 7])
    assert newcomer[0] == 0 and newcomer[-2:] == [6, 7], newcomer
    assert intake.established("newcomer")
    assert intake.state.by_peer[HONEST].accepted == 20 * 4  # the established peer: all
