"""Peer-id-bound tokens for the plain-TCP planes beside libp2p (the gossip payload plane,
bodies.py, and the shard data plane, node/broadcast/dataplane.py).

A client proves its peer id over libp2p (Noise) by asking for a token; the server answers
with an expiry and mac = HMAC-SHA256(node secret, domain || server id || client id ||
expiry_ms). Stateless: nothing is stored per token. Each plane has its own domain, so a
token of one plane is no token of the other.

The token never crosses the plain TCP connection. The server's first bytes on a new
connection are a fresh CHALLENGE_LEN-byte challenge; the client's first frame is the hello:
u32 BE length <= MAX_HELLO + msgpack `[client peer id, expiry_ms, proof]`, proof =
HMAC-SHA256(mac, PROOF_DOMAIN || challenge). So a hello seen on the path opens nothing: the
next connection has another challenge, and the proof does not give the mac away.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
import struct
import time

from ...protocol.codec import pack, unpack
from ...protocol.errors import ProtocolError

MAX_HELLO = 256
HELLO_HEADER = struct.Struct(">I")
CHALLENGE_LEN = 16
PROOF_DOMAIN = b"swarm-node/hello-proof/1\x00"


class TokenMac:
    """Macs and checks tokens bound to (this node, a client peer id) within `domain`."""

    def __init__(self, domain: bytes, peer_id: str, ttl_s: float, secret: bytes | None = None):
        self.domain = domain
        self.peer_id = peer_id
        self.ttl_s = ttl_s
        self.secret = secret or os.urandom(32)

    def mac(self, client: str, expiry_ms: int) -> bytes:
        msg = (self.domain + self.peer_id.encode() + b"\x00" + client.encode() + b"\x00"
               + expiry_ms.to_bytes(8, "big"))
        return hmac.new(self.secret, msg, hashlib.sha256).digest()

    def new(self, client: str) -> tuple[int, bytes]:
        """(expiry_ms, mac) of a fresh token for `client`."""
        expiry = int((time.time() + self.ttl_s) * 1000)
        return expiry, self.mac(client, expiry)

    def check(self, client: str, expiry_ms: int, proof: bytes, challenge: bytes) -> bool:
        """Whether `proof` answers `challenge` with an unexpired token of `client`."""
        if not 0 <= expiry_ms < 2**63 or expiry_ms < time.time() * 1000:
            return False
        return hmac.compare_digest(prove(self.mac(client, expiry_ms), challenge), proof)


def new_challenge() -> bytes:
    return os.urandom(CHALLENGE_LEN)


def prove(mac: bytes, challenge: bytes) -> bytes:
    """What the hello carries instead of the token's mac."""
    return hmac.new(mac, PROOF_DOMAIN + challenge, hashlib.sha256).digest()


def hello_frame(client: str, expiry_ms: int, mac: bytes, challenge: bytes) -> bytes:
    body = pack([client, expiry_ms, prove(mac, challenge)])
    return HELLO_HEADER.pack(len(body)) + body


async def read_hello(reader: asyncio.StreamReader) -> tuple[str, int, bytes] | None:
    """The claimed (peer id, expiry, proof), or None for anything malformed."""
    try:
        (n,) = HELLO_HEADER.unpack(await reader.readexactly(HELLO_HEADER.size))
        if n > MAX_HELLO:
            return None
        value = unpack(await reader.readexactly(n), max_size=MAX_HELLO)
    except (asyncio.IncompleteReadError, ProtocolError, ConnectionError, OSError):
        return None
    if (isinstance(value, list) and len(value) == 3 and isinstance(value[0], str)
            and 0 < len(value[0]) <= 128 and isinstance(value[1], int)
            and not isinstance(value[1], bool) and isinstance(value[2], bytes)):
        return value[0], value[1], value[2]
    return None
