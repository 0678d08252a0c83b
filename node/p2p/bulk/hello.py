"""The client's proof of identity inside the TLS channel (NODE_SPEC 3, bulk plane).

The server's first bytes after the handshake are a fresh CHALLENGE_LEN-byte challenge. The
client answers: u16 BE length (<= MAX_HELLO) + msgpack `[kind, client peer id, signature]`,
signature = Ed25519 by the client's key over DOMAIN || server peer id || 0x00 || client
peer id || 0x00 || kind || 0x00 || challenge. The server answers one status byte.

Why this is enough: the client checked the server's certificate (cert.py), so the challenge
came from the server it meant, through a channel nobody else reads; the signature names that
server, so a server that forwards it elsewhere opens nothing, and the challenge is new per
connection, so a hello seen once (by that server) opens no other connection.
"""

from __future__ import annotations

import os
import struct

from cryptography.exceptions import InvalidSignature

from ....protocol.codec import pack, unpack
from ....protocol.errors import BadPeerId, ProtocolError
from ....protocol.peerid import public_key_from_peer_id

DOMAIN = b"swarm-node/bulk-hello/1\x00"
CHALLENGE_LEN = 32
MAX_HELLO = 512
MAX_KIND = 16
HEADER = struct.Struct(">H")

# the server's answer to a hello
ACCEPTED = b"\x01"
BUSY = b"\x02"  # over the connection limits for this peer or address now
REFUSED = b"\x03"  # this peer is banned or cut
NO_HANDLER = b"\x04"  # no such request kind here
STATUS = {ACCEPTED: "accepted", BUSY: "busy", REFUSED: "refused", NO_HANDLER: "no_handler"}


def new_challenge() -> bytes:
    return os.urandom(CHALLENGE_LEN)


def signed_bytes(server: str, client: str, kind: str, challenge: bytes) -> bytes:
    return (DOMAIN + server.encode() + b"\x00" + client.encode() + b"\x00" + kind.encode()
            + b"\x00" + challenge)


def hello_frame(identity, server: str, kind: str, challenge: bytes) -> bytes:
    """The hello of `identity` to `server` for requests of `kind`."""
    sig = identity.sign(signed_bytes(server, identity.peer_id, kind, challenge))
    body = pack([kind, identity.peer_id, sig])
    return HEADER.pack(len(body)) + body


def parse_hello(body: bytes, server: str, challenge: bytes) -> tuple[str, str] | None:
    """(kind, client peer id) of a hello whose signature answers `challenge` for `server`;
    None for anything else."""
    try:
        value = unpack(body, max_size=MAX_HELLO)
    except ProtocolError:
        return None
    if not (isinstance(value, list) and len(value) == 3 and isinstance(value[0], str)
            and 0 < len(value[0]) <= MAX_KIND and isinstance(value[1], str)
            and 0 < len(value[1]) <= 128 and isinstance(value[2], bytes)
            and len(value[2]) == 64):
        return None
    kind, client, sig = value
    try:
        public_key_from_peer_id(client).verify(sig, signed_bytes(server, client, kind,
                                                                 challenge))
    except (BadPeerId, InvalidSignature):
        return None
    return kind, client
