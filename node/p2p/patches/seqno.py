"""Patch: pubsub seqnos start at the clock in nanoseconds, not seconds.

Message ids are (from, seqno), and py-libp2p 0.8.1 starts a Pubsub's seqno counter at the
current second (`int(time.time())`) and adds one per publish. A node restarted with the
same key within n seconds after publishing more than n messages reused seqnos, and every
peer that had seen them dropped the new messages as duplicates (found by
test_restart_with_same_key_rejoins). go-libp2p-pubsub and rust-libp2p start at the clock
in nanoseconds; so does this (fits the 8-byte field until 2554)."""

from __future__ import annotations

import time

from libp2p.pubsub.pubsub import Pubsub

from .registry import Patch, has_signature, register, sets_attribute

PATCH = register(Patch(
    name="seqno_from_nanoseconds",
    scope="pubsub",
    targets=("libp2p.pubsub.pubsub:Pubsub.counter",),
    why="seqnos start at the current second: a restart with the same key repeats them and "
        "peers drop the new messages as duplicates",
    upstream="none filed for py-libp2p (searched 2026-09); rust-libp2p PR #3716 and "
             "go-libp2p-pubsub PR #53 fixed the same",
    shape=lambda: (sets_attribute(Pubsub, "counter")
                   + has_signature(Pubsub, "_next_seqno", ("self",))),
))


def seqno_start() -> int:
    """First pubsub seqno of this process: the clock in nanoseconds, so that a restart with
    the same key never repeats a seqno of the previous run."""
    return time.time_ns()


def patch_seqno(pubsub) -> None:
    pubsub.counter = max(pubsub.counter, seqno_start())
