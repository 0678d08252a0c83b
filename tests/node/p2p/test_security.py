"""Only Noise and Yamux are offered: a plaintext-only (or mplex-only) dialer is refused."""

from __future__ import annotations

import asyncio

import multiaddr
import pytest
import trio  # test-side only: drives a bare py-libp2p host as the foreign dialer
from libp2p import new_host
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.crypto.x25519 import create_new_key_pair as create_x25519
from libp2p.peer.peerinfo import info_from_p2p_addr
from libp2p.security.insecure.transport import PLAINTEXT_PROTOCOL_ID, InsecureTransport
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_ID
from libp2p.security.noise.transport import Transport as NoiseTransport
from libp2p.stream_muxer.mplex.mplex import MPLEX_PROTOCOL_ID, Mplex
from libp2p.stream_muxer.yamux.yamux import PROTOCOL_ID as YAMUX_ID
from libp2p.stream_muxer.yamux.yamux import Yamux


def foreign_dial(addr: str, security: str, muxer: str) -> str:
    """Dial `addr` from a bare libp2p host; 'connected' or the error's type name."""
    kp = create_new_key_pair()
    sec = ({PLAINTEXT_PROTOCOL_ID: InsecureTransport(kp)} if security == "plaintext" else
           {NOISE_ID: NoiseTransport(kp, noise_privkey=create_x25519().private_key)})
    mux = {MPLEX_PROTOCOL_ID: Mplex} if muxer == "mplex" else {YAMUX_ID: Yamux}

    async def main() -> str:
        listen = [multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]
        host = new_host(key_pair=kp, sec_opt=sec, muxer_opt=mux, listen_addrs=listen)
        host.get_network().retry_config.max_retries = 0
        async with host.run(listen_addrs=listen):
            try:
                with trio.fail_after(10):
                    await host.connect(info_from_p2p_addr(multiaddr.Multiaddr(addr)))
                    # a connection that survives a stream open is a real one
                    return "connected" if host.get_connected_peers() else "no connection"
            except Exception as e:  # noqa: BLE001 - the outcome is what the test checks
                return type(e).__name__
            finally:
                await host.close()

    return trio.run(main)


@pytest.mark.parametrize("security,muxer,expect_ok", [
    ("noise", "yamux", True),       # control: the test dialer works at all
    ("plaintext", "yamux", False),
    ("noise", "mplex", False),
])
async def test_only_noise_and_yamux_are_accepted(make_node, security, muxer, expect_ok):
    node = await make_node(discovery=False)
    outcome = await asyncio.to_thread(foreign_dial, node.listen_addrs[0], security, muxer)
    if expect_ok:
        assert outcome == "connected"
    else:
        assert outcome != "connected"
        # The dialer has given up: had the handshake succeeded, the connection would exist.
        assert node.connected_peers() == []
