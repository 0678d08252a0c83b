"""Plain py-libp2p hosts and pubsubs (Noise + Yamux on loopback) without our per-host or
per-pubsub patches, for the tests that show what py-libp2p does on its own. Test-only."""

from __future__ import annotations

from contextlib import AsyncExitStack, asynccontextmanager

import multiaddr
from libp2p import new_host
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.crypto.x25519 import create_new_key_pair as create_x25519_key_pair
from libp2p.peer.peerinfo import info_from_p2p_addr
from libp2p.pubsub.gossipsub import PROTOCOL_ID, PROTOCOL_ID_V11, GossipSub
from libp2p.pubsub.pubsub import Pubsub
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
from libp2p.security.noise.transport import Transport as NoiseTransport
from libp2p.stream_muxer.yamux.yamux import PROTOCOL_ID as YAMUX_PROTOCOL_ID
from libp2p.stream_muxer.yamux.yamux import Yamux
from libp2p.tools.anyio_service import background_trio_service

from tests.waiting import trio_wait_until

LOOPBACK = multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")


def raw_host():
    key_pair = create_new_key_pair()
    noise = NoiseTransport(key_pair, noise_privkey=create_x25519_key_pair().private_key)
    return new_host(key_pair=key_pair, sec_opt={NOISE_PROTOCOL_ID: noise},
                    muxer_opt={YAMUX_PROTOCOL_ID: Yamux}, listen_addrs=[LOOPBACK])


CREATED: list[Pubsub] = []  # each owns a seen-cache sweeper thread: stopped after the test


def raw_pubsub(host, degree: int = 3) -> tuple[GossipSub, Pubsub]:
    router = GossipSub(protocols=[PROTOCOL_ID_V11, PROTOCOL_ID], degree=degree,
                       degree_low=max(1, degree - 1), degree_high=degree + 1,
                       heartbeat_initial_delay=0.1, heartbeat_interval=0.5)
    pubsub = Pubsub(host, router, strict_signing=True)
    CREATED.append(pubsub)
    return router, pubsub


def stop_sweepers() -> None:
    while CREATED:
        CREATED.pop().seen_messages.stop()


@asynccontextmanager
async def running(*hosts, pubsubs=()):
    """Run the hosts (listening on loopback) and the (router, pubsub) pairs."""
    async with AsyncExitStack() as stack:
        for host in hosts:
            await stack.enter_async_context(host.run(listen_addrs=[LOOPBACK]))
        for router, pubsub in pubsubs:
            await stack.enter_async_context(background_trio_service(pubsub))
            await stack.enter_async_context(background_trio_service(router))
            await pubsub.wait_until_ready()
        yield


async def connect(dialer, listener) -> None:
    await dialer.connect(info_from_p2p_addr(multiaddr.Multiaddr(str(listener.get_addrs()[0]))))


async def until(pred, timeout: float = 15, what: str = "condition") -> None:
    """Wait (trio) until `pred()` holds, at most `timeout` seconds: py-libp2p's own state,
    which nothing signals (tests/waiting.py)."""
    await trio_wait_until(pred, timeout, what)


class Wire:
    """A raw connection in memory: writes are recorded; reads return the recorded bytes in
    `chunk`-sized pieces, then b"" (end of stream)."""

    def __init__(self, chunk: int = 1 << 20):
        self.sent = bytearray()
        self.writes = 0
        self.reads = 0
        self.chunk = chunk
        self.pos = 0

    async def write(self, data) -> None:
        self.sent.extend(data)
        self.writes += 1

    async def read(self, n: int | None = None) -> bytes:
        self.reads += 1
        out = bytes(self.sent[self.pos:self.pos + min(n or self.chunk, self.chunk)])
        self.pos += len(out)
        return out


def noise_session_pair(wire: Wire):
    """(writer, reader): both ends of one Noise session (NN handshake in memory) over `wire`,
    as py-libp2p's NoiseTransportReadWriter."""
    from libp2p.security.noise.io import NoiseTransportReadWriter
    from noise.connection import NoiseConnection

    a = NoiseConnection.from_name(b"Noise_NN_25519_ChaChaPoly_SHA256")
    b = NoiseConnection.from_name(b"Noise_NN_25519_ChaChaPoly_SHA256")
    a.set_as_initiator()
    b.set_as_responder()
    a.start_handshake()
    b.start_handshake()
    b.read_message(a.write_message())
    a.read_message(b.write_message())
    return NoiseTransportReadWriter(wire, a), NoiseTransportReadWriter(wire, b)
