"""patches/relay.py: each test shows the py-libp2p 0.8.1 fault with the upstream class (it
fails once upstream fixes it: then drop the patch) and its absence with ours."""

from __future__ import annotations

from contextlib import AsyncExitStack
from types import SimpleNamespace

import multiaddr
import pytest
import trio
from libp2p import new_host
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.crypto.x25519 import create_new_key_pair as create_x25519_key_pair
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo
from libp2p.relay.circuit_v2.config import RelayConfig, RelayRole
from libp2p.relay.circuit_v2.pb.circuit_pb2 import HopMessage
from libp2p.relay.circuit_v2.protocol import PROTOCOL_ID as HOP
from libp2p.relay.circuit_v2.protocol import CircuitV2Protocol
from libp2p.relay.circuit_v2.resources import RelayLimits, RelayResourceManager
from libp2p.relay.circuit_v2.transport import CircuitV2Transport
from libp2p.relay.circuit_v2.utils import read_delimited_msg, write_delimited_msg
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE
from libp2p.security.noise.transport import Transport as Noise
from libp2p.stream_muxer.yamux.yamux import PROTOCOL_ID as YAMUX
from libp2p.stream_muxer.yamux.yamux import Yamux
from libp2p.tools.anyio_service import background_trio_service
from swarm_node.node.p2p.patches.relay import RelayProtocol, RelayReservations, shape

LIMITS = RelayLimits(duration=600, data=1 << 24, max_circuit_conns=4, max_reservations=1)
ECHO = "/test/echo/1.0.0"


def test_patch_still_applies():
    assert shape() == []


def _host(ip: str):
    kp = create_new_key_pair()
    listen = [multiaddr.Multiaddr(f"/ip4/{ip}/tcp/0")]
    noise = Noise(kp, noise_privkey=create_x25519_key_pair().private_key)
    return new_host(key_pair=kp, sec_opt={NOISE: noise}, muxer_opt={YAMUX: Yamux},
                    listen_addrs=listen), listen


async def _second_circuit_survives_the_first(protocol_cls) -> bool:
    """Relay R; A reserved on R; B and C reach A through R; B leaves. Does C's circuit to
    A still carry data?"""
    hosts = [_host(f"127.0.0.{i}") for i in (1, 2, 3, 4)]
    async with AsyncExitStack() as stack:
        for h, listen in hosts:
            await stack.enter_async_context(h.run(listen))
        (r, _), (a, _), (b, _), (c, _) = hosts
        protocols = [protocol_cls(h, limits=LIMITS, allow_hop=(i == 0))
                     for i, (h, _) in enumerate(hosts)]
        for p in protocols:
            await stack.enter_async_context(background_trio_service(p))
        for h in (a, b, c):
            await h.connect(PeerInfo(r.get_id(), r.get_addrs()))

        async def echo(stream) -> None:
            while data := await stream.read(100):
                await stream.write(data)

        a.set_stream_handler(ECHO, echo)
        reserve = await a.new_stream(r.get_id(), [HOP])
        await write_delimited_msg(reserve, HopMessage(type=HopMessage.RESERVE))
        assert (await read_delimited_msg(reserve, HopMessage)).status == 100
        circuit = multiaddr.Multiaddr(f"{r.get_addrs()[0]}/p2p-circuit/p2p/{a.get_id()}")
        for h, p in ((b, protocols[2]), (c, protocols[3])):
            await CircuitV2Transport(h, p, RelayConfig(roles=RelayRole.STOP)).dial(circuit)
        to_a = await c.new_stream(a.get_id(), [ECHO])
        await to_a.write(b"hi")
        assert await to_a.read(100) == b"hi"  # C's circuit works before B leaves
        await b.disconnect(a.get_id())
        await trio.sleep(1.0)  # let the relay tear B's circuit down
        try:
            with trio.fail_after(5):
                await to_a.write(b"ping")
                return await to_a.read(100) == b"ping"
        except Exception:  # noqa: BLE001 - a reset circuit is the fault under test
            return False


@pytest.mark.parametrize("cls, survives", [(CircuitV2Protocol, False), (RelayProtocol, True)])
def test_one_circuit_ending_leaves_another_to_the_same_peer(cls, survives):
    assert trio.run(_second_circuit_survives_the_first, cls) is survives


@pytest.mark.parametrize("cls, accepted", [(RelayResourceManager, False),
                                            (RelayReservations, True)])
def test_a_departed_peers_slot_is_free(cls, accepted):
    connections: dict = {}
    host = SimpleNamespace(get_network=lambda: SimpleNamespace(connections=connections),
                           get_peerstore=lambda: None, get_id=lambda: None)
    manager = cls(LIMITS, host)
    first, second = ID(b"\x00\x01a"), ID(b"\x00\x01b")
    connections[first] = ["conn"]
    manager.reserve(first)
    del connections[first]  # it left
    assert manager.can_accept_reservation(second) is accepted
