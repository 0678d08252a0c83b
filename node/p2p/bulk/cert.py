"""TLS 1.3 certificates bound to the node's Ed25519 identity, as in libp2p's TLS handshake
(libp2p/specs tls/tls.md), and the TLS contexts of the bulk plane.

A node makes a fresh P-256 key per process and a self-signed certificate for it that
carries the libp2p Public Key Extension (OID 1.3.6.1.4.1.53594.1.1): DER
`SEQUENCE { publicKey OCTET STRING, signature OCTET STRING }`, publicKey = the protobuf
PublicKey of the node's Ed25519 key, signature = Ed25519 over "libp2p-tls-handshake:" ||
the certificate key's SubjectPublicKeyInfo (DER). A client accepts a server only if that
extension names the peer id it meant to reach (`peer_id_of`).

Python's `ssl` has no verification callback, and OpenSSL's own chain check refuses a
self-signed certificate nobody vouches for. So the contexts skip the chain check
(`CERT_NONE`) and the client checks the certificate right after the handshake, before
sending a byte: OpenSSL still verifies the server's CertificateVerify signature (proof
that the server holds the certificate key) whatever `verify_mode` says, and the extension
binds that key to the peer id. Servers request no client certificate (`CERT_NONE` sends no
CertificateRequest); a client proves its identity inside the channel instead (hello.py).
"""

from __future__ import annotations

import datetime
import os
import ssl
import tempfile

from cryptography import x509
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from ....protocol.errors import BadPeerId
from ....protocol.peerid import peer_id_from_public_bytes, public_key_from_peer_id
from ..errors import P2PError

EXTENSION_OID = x509.ObjectIdentifier("1.3.6.1.4.1.53594.1.1")
SIGNATURE_PREFIX = b"libp2p-tls-handshake:"
ALPN = "swarm-node-bulk/1"
_PB_ED25519 = bytes([0x08, 0x01, 0x12, 0x20])  # protobuf PublicKey{Type: Ed25519, Data: 32 B}
_CLOCK_SLACK = datetime.timedelta(hours=1)
_LIFETIME = datetime.timedelta(days=3650)


class CertificateError(P2PError):
    """A peer's certificate does not prove the identity it was expected to have."""

    reason = "bad_certificate"


# DER: just the two-octet-string SEQUENCE the extension holds -------------------------------

def _der_len(n: int) -> bytes:
    if n < 0x80:
        return bytes([n])
    raw = n.to_bytes((n.bit_length() + 7) // 8, "big")
    return bytes([0x80 | len(raw)]) + raw


def _der(tag: int, body: bytes) -> bytes:
    return bytes([tag]) + _der_len(len(body)) + body


def _der_read(data: bytes, pos: int, tag: int) -> tuple[bytes, int]:
    """The body of the element of type `tag` at `pos`, and the position after it."""
    if pos + 2 > len(data) or data[pos] != tag:
        raise CertificateError("malformed libp2p key extension")
    n, pos = data[pos + 1], pos + 2
    if n & 0x80:
        k = n & 0x7F
        if not 1 <= k <= 2 or pos + k > len(data):
            raise CertificateError("malformed libp2p key extension")
        n, pos = int.from_bytes(data[pos:pos + k], "big"), pos + k
    if pos + n > len(data):
        raise CertificateError("malformed libp2p key extension")
    return data[pos:pos + n], pos + n


def encode_signed_key(public_key_pb: bytes, signature: bytes) -> bytes:
    return _der(0x30, _der(0x04, public_key_pb) + _der(0x04, signature))


def decode_signed_key(data: bytes) -> tuple[bytes, bytes]:
    seq, end = _der_read(data, 0, 0x30)
    if end != len(data):
        raise CertificateError("trailing bytes after the libp2p key extension")
    key, pos = _der_read(seq, 0, 0x04)
    sig, pos = _der_read(seq, pos, 0x04)
    if pos != len(seq):
        raise CertificateError("malformed libp2p key extension")
    return key, sig


# Certificates ------------------------------------------------------------------------------

def make_certificate(identity) -> tuple[bytes, bytes]:
    """(certificate PEM, private key PEM) of a fresh P-256 key, bound to `identity`."""
    key = ec.generate_private_key(ec.SECP256R1())
    spki = key.public_key().public_bytes(serialization.Encoding.DER,
                                         serialization.PublicFormat.SubjectPublicKeyInfo)
    signed = encode_signed_key(_PB_ED25519 + identity.public_bytes,
                               identity.sign(SIGNATURE_PREFIX + spki))
    now = datetime.datetime.now(datetime.UTC)
    name = x509.Name([x509.NameAttribute(NameOID.SERIAL_NUMBER,
                                         str(int.from_bytes(os.urandom(8), "big")))])
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - _CLOCK_SLACK).not_valid_after(now + _LIFETIME)
            .add_extension(x509.UnrecognizedExtension(EXTENSION_OID, signed), critical=True)
            .sign(key, hashes.SHA256()))
    return (cert.public_bytes(serialization.Encoding.PEM),
            key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                              serialization.NoEncryption()))


def peer_id_of(der: bytes | None) -> str:
    """The peer id a DER certificate proves (self-signature, validity, the libp2p key
    extension and its signature over the certificate key); CertificateError otherwise."""
    if not der:
        raise CertificateError("no certificate")
    try:
        cert = x509.load_der_x509_certificate(der)
        now = datetime.datetime.now(datetime.UTC)
        if not cert.not_valid_before_utc - _CLOCK_SLACK <= now <= cert.not_valid_after_utc:
            raise CertificateError("certificate not valid now")
        cert.verify_directly_issued_by(cert)  # self-signed by the key TLS proved
        ext = cert.extensions.get_extension_for_oid(EXTENSION_OID).value
        key_pb, signature = decode_signed_key(ext.value)
        if len(key_pb) != 36 or not key_pb.startswith(_PB_ED25519):
            raise CertificateError("the libp2p key extension holds no Ed25519 key")
        peer = peer_id_from_public_bytes(key_pb[4:])
        spki = cert.public_key().public_bytes(serialization.Encoding.DER,
                                              serialization.PublicFormat.SubjectPublicKeyInfo)
        public_key_from_peer_id(peer).verify(signature, SIGNATURE_PREFIX + spki)
        return peer
    except CertificateError:
        raise
    except x509.ExtensionNotFound:
        raise CertificateError("certificate without the libp2p key extension") from None
    except InvalidSignature:
        raise CertificateError("the libp2p key extension's signature is invalid") from None
    except (ValueError, TypeError, BadPeerId, UnsupportedAlgorithm) as e:
        raise CertificateError(f"unusable certificate: {e}") from None
    except Exception as e:  # noqa: BLE001 - the parser has more error types (InvalidVersion)
        raise CertificateError(f"unusable certificate: {type(e).__name__}: {e}") from None


# Contexts ----------------------------------------------------------------------------------

def _base(server: bool) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE  # the peer id check replaces the chain check (above)
    ctx.set_alpn_protocols([ALPN])
    return ctx


def server_context(identity) -> ssl.SSLContext:
    """The server side: a certificate bound to `identity` (files only for the load: `ssl`
    reads keys from files; a 0700 directory, removed at once)."""
    cert_pem, key_pem = make_certificate(identity)
    ctx = _base(server=True)
    ctx.num_tickets = 0  # no session resumption: no tickets to make and send
    with tempfile.TemporaryDirectory(prefix="swarm-bulk-") as d:
        cert_path, key_path = os.path.join(d, "cert.pem"), os.path.join(d, "key.pem")
        for path, data in ((cert_path, cert_pem), (key_path, key_pem)):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
        ctx.load_cert_chain(cert_path, key_path)
    return ctx


def client_context() -> ssl.SSLContext:
    return _base(server=False)
