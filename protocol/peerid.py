"""libp2p peer IDs for Ed25519 keys, computed without importing libp2p.

An Ed25519 public key's protobuf encoding (KeyType=1, Data=32 bytes) is 36 bytes, short
enough that libp2p uses the *identity* multihash: the peer ID contains the key itself, so a
receiver can check a signature against the sender's peer ID with no key exchange.
"""

from __future__ import annotations

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from .errors import BadPeerId

_B58 = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"
_B58_INDEX = {c: i for i, c in enumerate(_B58)}
# protobuf PublicKey{Type: Ed25519 (field 1 = 1), Data (field 2, 32 bytes)}
_PB_PREFIX = bytes([0x08, 0x01, 0x12, 0x20])
# identity multihash: code 0x00, length 36
_MH_PREFIX = bytes([0x00, 0x24])
PEER_ID_LEN = 52  # base58 of 38 bytes, starting "12D3KooW"


def b58encode(data: bytes) -> str:
    n = int.from_bytes(data, "big")
    out = []
    while n:
        n, r = divmod(n, 58)
        out.append(_B58[r])
    pad = len(data) - len(data.lstrip(b"\0"))
    return "1" * pad + "".join(reversed(out))


def b58decode(text: str) -> bytes:
    if len(text) > 128:
        raise BadPeerId("peer ID too long")
    n = 0
    for c in text:
        if c not in _B58_INDEX:
            raise BadPeerId(f"invalid base58 character {c!r} in peer ID")
        n = n * 58 + _B58_INDEX[c]
    body = n.to_bytes((n.bit_length() + 7) // 8, "big") if n else b""
    pad = len(text) - len(text.lstrip("1"))
    return b"\0" * pad + body


def peer_id_from_public_bytes(raw: bytes) -> str:
    if len(raw) != 32:
        raise ValueError("Ed25519 public key must be 32 bytes")
    return b58encode(_MH_PREFIX + _PB_PREFIX + raw)


def public_key_from_peer_id(peer_id: str) -> Ed25519PublicKey:
    """The Ed25519 key embedded in `peer_id`; BadPeerId if it is not such an ID."""
    if not isinstance(peer_id, str):
        raise BadPeerId("peer ID must be a string")
    raw = b58decode(peer_id)
    if len(raw) != 38 or not raw.startswith(_MH_PREFIX + _PB_PREFIX):
        raise BadPeerId(f"{peer_id[:60]!r} is not an Ed25519 identity-multihash peer ID")
    try:
        return Ed25519PublicKey.from_public_bytes(raw[6:])
    except ValueError as e:
        raise BadPeerId(f"peer ID holds an invalid Ed25519 key: {e}") from None
