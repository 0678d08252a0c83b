"""Patch: the signed peer record py-libp2p attaches to every pubsub RPC is verified once
per (peer, record), and our own is rebuilt at most every RECORD_MEMO_S.

py-libp2p 0.8.1 attaches the sender's signed peer record to every pubsub RPC and, on every
RPC received, parses it, verifies its Ed25519 signature and rewrites the peerstore entry;
on every RPC sent it lists the host's addresses (getsockname per listener) and re-marshals
the cached record: CPU per message per hop. Both module functions (in `pubsub` and
`gossipsub`, which import them by name) are memoised: a record already accepted byte for
byte from that peer is not verified again for RECORD_MEMO_S, and the outgoing record is
rebuilt at most every RECORD_MEMO_S (py-libp2p re-issues it if the addresses changed
meanwhile). The memos live on the host object: keyed by id(host) in a module dict (as
once), a new host that got a closed host's id sent that host's record for up to
RECORD_MEMO_S, and its peers, seeing a record of another peer, dropped every RPC of it."""

from __future__ import annotations

import time

import libp2p.pubsub.gossipsub as gossipsub_mod
import libp2p.pubsub.pubsub as pubsub_mod

from .registry import Patch, has_signature, register, replace

PATCH = register(Patch(
    name="signed_record_memo",
    scope="process",
    targets=("libp2p.pubsub.pubsub:maybe_consume_signed_record",
             "libp2p.pubsub.pubsub:env_to_send_in_RPC",
             "libp2p.pubsub.gossipsub:maybe_consume_signed_record",
             "libp2p.pubsub.gossipsub:env_to_send_in_RPC"),
    why="every pubsub RPC received verifies the sender's signed record again, and every "
        "RPC sent lists our addresses and re-marshals ours (CPU per message per hop)",
    upstream="introduced by py-libp2p PR #889 (signed records in pubsub, 2025-09); no "
             "issue on its cost (searched 2026-09)",
    shape=lambda: [msg for mod in (pubsub_mod, gossipsub_mod) for msg in
                   has_signature(mod, "maybe_consume_signed_record",
                                 ("msg", "host", "peer_id"))
                   + has_signature(mod, "env_to_send_in_RPC", ("host",))],
))

RECORD_MEMO_S = 60.0
_MAX_MEMO = 4096


def install() -> None:
    for mod in (pubsub_mod, gossipsub_mod):
        replace(mod, "maybe_consume_signed_record",
                _memo_consume(mod.maybe_consume_signed_record))
        replace(mod, "env_to_send_in_RPC", _memo_outgoing(mod.env_to_send_in_RPC))


def _memo_consume(inner):
    if getattr(inner, "_swarm_memo", False):
        return inner

    def consume(msg, host, peer_id) -> bool:
        if not msg.HasField("senderRecord"):
            return True
        consumed: dict[tuple[bytes, bytes], float] | None = getattr(host, "_swarm_consumed",
                                                                   None)
        if consumed is None:
            consumed = host._swarm_consumed = {}
        key = (peer_id.to_bytes(), msg.senderRecord)
        now = time.monotonic()
        if consumed.get(key, 0.0) > now:
            return True
        ok = inner(msg, host, peer_id)
        if ok:
            if len(consumed) >= _MAX_MEMO:
                consumed.clear()
            consumed[key] = now + RECORD_MEMO_S
        return ok

    consume._swarm_memo = True
    return consume


def _memo_outgoing(inner):
    if getattr(inner, "_swarm_memo", False):
        return inner

    def outgoing(host) -> tuple[bytes, bool]:
        now = time.monotonic()
        hit = getattr(host, "_swarm_outgoing", None)
        if hit is not None and hit[0] > now:
            return hit[1][0], False
        value = inner(host)
        host._swarm_outgoing = (now + RECORD_MEMO_S, value)
        return value

    outgoing._swarm_memo = True
    return outgoing
