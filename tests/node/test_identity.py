"""Node identity: the same Ed25519 key is the libp2p host key and the message signer."""

from __future__ import annotations

import os
import stat

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from swarm_node.node.errors import IdentityError, NodeError
from swarm_node.node.identity import KEY_FILE_MODE, Identity
from swarm_node.protocol.envelope import open_envelope
from swarm_node.protocol.messages import Status
from swarm_node.protocol.peerid import public_key_from_peer_id


def _mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _write(path, data: bytes, mode: int = 0o600):
    path.write_bytes(data)
    os.chmod(path, mode)
    return path


def test_peer_id_equals_py_libp2p():
    from libp2p.crypto.ed25519 import Ed25519PrivateKey as Libp2pKey
    from libp2p.peer.id import ID

    for _ in range(5):
        ident = Identity.generate()
        # Via our own conversion, and independently from the raw private bytes.
        ours = ident.to_libp2p_keypair()
        theirs = Libp2pKey.from_bytes(ident.private_bytes).get_public_key()
        assert ID.from_pubkey(ours.public_key).to_base58() == ident.peer_id
        assert ID.from_pubkey(theirs).to_base58() == ident.peer_id
        assert ID.from_base58(ident.peer_id).extract_public_key().to_bytes() == ident.public_bytes


def test_libp2p_generated_key_gives_same_peer_id():
    from libp2p.crypto.ed25519 import create_new_key_pair
    from libp2p.peer.id import ID

    pair = create_new_key_pair()
    ident = Identity(Ed25519PrivateKey.from_private_bytes(pair.private_key.to_bytes()[:32]))
    assert ident.peer_id == ID.from_pubkey(pair.public_key).to_base58()


def test_signature_verifies_under_libp2p_and_peer_id():
    ident = Identity.generate()
    sig = ident.sign(b"hello")
    assert ident.to_libp2p_keypair().public_key.verify(b"hello", sig)
    public_key_from_peer_id(ident.peer_id).verify(sig, b"hello")  # raises if not
    env = open_envelope(ident.seal(Status(swarm_id="s", role="relay")))
    assert env.sender == ident.peer_id


def test_save_load_round_trip_with_0600(tmp_path):
    ident = Identity.generate()
    path = tmp_path / "sub" / "node_key.pem"
    ident.save(path)
    assert _mode(path) == KEY_FILE_MODE == 0o600
    assert path.read_bytes().startswith(b"-----BEGIN PRIVATE KEY-----")
    assert Identity.load(path).peer_id == ident.peer_id
    assert not path.with_name(path.name + ".tmp").exists()


def test_save_replaces_a_loose_file_with_0600(tmp_path):
    path = _write(tmp_path / "key.pem", b"old", 0o644)
    old_umask = os.umask(0)
    try:
        Identity.generate().save(path)
    finally:
        os.umask(old_umask)
    assert _mode(path) == 0o600


def test_save_does_not_follow_a_planted_tmp_symlink(tmp_path):
    target = tmp_path / "elsewhere"
    target.write_bytes(b"untouched")
    (tmp_path / "key.pem.tmp").symlink_to(target)
    Identity.generate().save(tmp_path / "key.pem")
    assert target.read_bytes() == b"untouched"
    assert Identity.load(tmp_path / "key.pem")


def test_load_or_create_is_stable(tmp_path):
    path = tmp_path / "k.pem"
    first = Identity.load_or_create(path)
    assert _mode(path) == 0o600
    assert Identity.load_or_create(path).peer_id == first.peer_id


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660, 0o777])
def test_wrong_permissions(tmp_path, mode):
    path = tmp_path / "key.pem"
    Identity.generate().save(path)
    os.chmod(path, mode)
    with pytest.raises(IdentityError) as e:
        Identity.load(path)
    msg = str(e.value)
    assert str(path) in msg and f"{mode:04o}" in msg and "chmod 600" in msg


@pytest.mark.parametrize("content", [
    b"", b"garbage", b"-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n",
    os.urandom(200),
])
def test_corrupt_key(tmp_path, content):
    path = _write(tmp_path / "key.pem", content)
    with pytest.raises(IdentityError) as e:
        Identity.load(path)
    assert str(path) in str(e.value) and "not a valid PEM" in str(e.value)


@pytest.mark.parametrize("make_key", [
    lambda: rsa.generate_private_key(public_exponent=65537, key_size=1024),
    lambda: ec.generate_private_key(ec.SECP256R1()),
], ids=["rsa", "ec"])
def test_non_ed25519_key(tmp_path, make_key):
    pem = make_key().private_bytes(serialization.Encoding.PEM,
                                   serialization.PrivateFormat.PKCS8,
                                   serialization.NoEncryption())
    path = _write(tmp_path / "key.pem", pem)
    with pytest.raises(IdentityError) as e:
        Identity.load(path)
    assert str(path) in str(e.value) and "Ed25519" in str(e.value)


def test_encrypted_key(tmp_path):
    pem = Ed25519PrivateKey.generate().private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.BestAvailableEncryption(b"pw"))
    path = _write(tmp_path / "key.pem", pem)
    with pytest.raises(IdentityError, match=str(path)):
        Identity.load(path)


def test_missing_and_unreadable(tmp_path):
    with pytest.raises(IdentityError, match="keygen"):
        Identity.load(tmp_path / "absent.pem")
    d = tmp_path / "dir.pem"
    d.mkdir(mode=0o700)
    with pytest.raises(IdentityError, match=str(d)):
        Identity.load(d)


def test_unwritable_location(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(IdentityError, match="cannot write key file"):
        Identity.generate().save(blocker / "key.pem")


def test_identity_error_is_node_error():
    assert issubclass(IdentityError, NodeError)
