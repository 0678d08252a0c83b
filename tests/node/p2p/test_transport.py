"""The seam roles and the broadcaster type against: `Transport` (node/p2p/__init__.py).
P2PNode and the shipped in-memory fake have each of its members with the same parameters,
and the fake behaves like a node where unit tests lean on it (gossip to others only, the
peer filter, requests, provider records)."""

from __future__ import annotations

import inspect

import pytest
from swarm_node.node.identity import Identity
from swarm_node.node.p2p import P2PNode, RequestError, Transport
from swarm_node.node.testing.transport import FakeNetwork, FakeTransport

from .conftest import p2p_config, verdict


def members() -> list[str]:
    names = set(Transport.__annotations__)
    names |= {n for n in vars(Transport) if not n.startswith("_")}
    return sorted(names)


@pytest.fixture
async def implementations():
    node = P2PNode(Identity.generate(), p2p_config())  # not started: the shape is the point
    yield {"P2PNode": node, "FakeTransport": FakeTransport(Identity.generate())}
    await node.close()


async def test_p2pnode_and_the_fake_have_every_member_of_the_interface(implementations):
    assert {"publish", "request", "find_providers", "report_misbehaviour", "bulk"} <= set(
        members())
    for name, impl in implementations.items():
        for member in members():
            assert hasattr(impl, member), f"{name} lacks Transport.{member}"
            declared = inspect.getattr_static(Transport, member, None)
            if inspect.isfunction(declared):
                want = list(inspect.signature(declared).parameters)[1:]  # without self
                got = list(inspect.signature(getattr(impl, member)).parameters)
                assert got == want, f"{name}.{member}{got} differs from Transport's {want}"


async def test_the_fake_gossips_to_the_others_and_honours_the_peer_filter():
    net = FakeNetwork()
    a, b, c = net.join(), net.join(), net.join()
    got: dict[str, list] = {"a": [], "b": [], "c": []}
    for name, node in (("a", a), ("b", b), ("c", c)):
        await node.subscribe("verdicts", lambda env, peer, name=name: _take(got[name], env, peer))
    c.set_peer_filter(lambda peer: peer != a.peer_id)
    await a.publish("verdicts", verdict(7))
    assert got["a"] == [] and got["c"] == []  # not back to the sender; c refuses a
    assert got["b"] == [(a.peer_id, a.peer_id, "verdict")]
    assert a.published == [("verdicts", verdict(7))]


async def _take(into: list, env, peer: str) -> None:
    into.append((env.sender, peer, env.type))


async def test_the_fake_serves_requests_and_provider_records():
    net = FakeNetwork()
    a, b = net.join(), net.join()

    async def echo(peer: str, body: bytes) -> bytes:
        return peer.encode() + body

    await b.set_request_handler("/test/echo/1", echo)
    assert await a.request(b.peer_id, "/test/echo/1", b"!") == a.peer_id.encode() + b"!"
    with pytest.raises(RequestError):
        await a.request(b.peer_id, "/test/none/1", b"")
    b.set_peer_filter(lambda peer: False)
    with pytest.raises(RequestError):
        await a.request(b.peer_id, "/test/echo/1", b"!")
    assert await b.provide(b"key")
    assert [p for p, _ in await a.find_providers(b"key")] == [b.peer_id]
    assert await a.find_providers(b"other") == []
