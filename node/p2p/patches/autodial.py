"""Patch: py-libp2p's AutoConnector does not dial; discovery.py owns dialing.

py-libp2p 0.8.1's AutoConnector dials every peerstore peer that is not connected (every
10 s while under its low watermark of 100 connections, i.e. always in a swarm of our size),
beside discovery.py: a peer then got two connections dialled at once (the pair's later close
is what lost pubsub peering, see subscriptions.py), and a peer that our penalties cut (and
refuse for 30 s to an hour) is dialled again after py-libp2p's own 60 s disconnect backoff.
discovery.py owns dialing (target_peers, backoff, refusals), so the host's AutoConnector is
switched off."""

from __future__ import annotations

from libp2p.network.auto_connector import AutoConnector
from libp2p.network.swarm import Swarm

from .registry import Patch, has_signature, register, sets_attribute

PATCH = register(Patch(
    name="no_auto_connect",
    scope="host",
    targets=("libp2p.network.auto_connector:AutoConnector.maybe_connect (per host)",),
    why="the AutoConnector dials known peers beside our discovery, cut peers included",
    upstream="py-libp2p #1451 (closed 2026-08: dial pipeline and auto-connector issues; "
             "redial of peers the application cut is not addressed)",
    shape=lambda: (has_signature(AutoConnector, "maybe_connect", ("self",), coroutine=True)
                   + sets_attribute(Swarm, "auto_connector")),
))


async def _no_auto_connect() -> None:
    return None


def patch_auto_connector(host) -> None:
    host.get_network().auto_connector.maybe_connect = _no_auto_connect
