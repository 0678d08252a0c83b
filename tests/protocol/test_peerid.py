"""Peer IDs: the Ed25519 key travels inside the ID (identity multihash)."""

from __future__ import annotations

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from swarm_node.protocol.errors import BadPeerId
from swarm_node.protocol.peerid import (
    PEER_ID_LEN,
    b58decode,
    b58encode,
    peer_id_from_public_bytes,
    public_key_from_peer_id,
)


@pytest.mark.parametrize("data", [b"", b"\x00", b"\x00\x00\x01", b"hello", bytes(range(80))])
def test_base58_round_trip(data):
    assert b58decode(b58encode(data)) == data


def test_known_base58_vector():
    assert b58encode(b"hello world") == "StV1DL6CwTryKyV"


def test_peer_id_embeds_key():
    key = Ed25519PrivateKey.generate().public_key()
    raw = key.public_bytes(Encoding.Raw, PublicFormat.Raw)
    pid = peer_id_from_public_bytes(raw)
    assert pid.startswith("12D3KooW") and len(pid) == PEER_ID_LEN
    assert public_key_from_peer_id(pid).public_bytes(Encoding.Raw, PublicFormat.Raw) == raw


@pytest.mark.parametrize("bad", [
    "", "0OIl", "x" * 129, "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N",  # sha256 ID
    "12D3KooW", 5, None, b"12D3KooW",
])
def test_bad_peer_ids(bad):
    with pytest.raises(BadPeerId):
        public_key_from_peer_id(bad)


def test_public_bytes_length_checked():
    with pytest.raises(ValueError):
        peer_id_from_public_bytes(b"\x00" * 31)
