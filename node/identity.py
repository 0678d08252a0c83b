"""The node's Ed25519 identity: one key is both the libp2p host key and the message signer."""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from ..protocol.envelope import seal
from ..protocol.peerid import peer_id_from_public_bytes
from .errors import IdentityError

KEY_FILE_MODE = 0o600


@dataclass(frozen=True)
class Identity:
    private_key: Ed25519PrivateKey

    @classmethod
    def generate(cls) -> Identity:
        return cls(Ed25519PrivateKey.generate())

    @property
    def public_bytes(self) -> bytes:
        return self.private_key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw)

    @property
    def private_bytes(self) -> bytes:
        return self.private_key.private_bytes(
            serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
            serialization.NoEncryption())

    @property
    def peer_id(self) -> str:
        return peer_id_from_public_bytes(self.public_bytes)

    def sign(self, data: bytes) -> bytes:
        return self.private_key.sign(data)

    def seal(self, message) -> bytes:
        """Sign a wire message into an envelope as this node."""
        return seal(message, self.private_key, self.peer_id)

    def to_libp2p_keypair(self):
        """The same key as a py-libp2p KeyPair."""
        # libp2p (and trio) load only when a host starts: `keygen` and `id` do without.
        from libp2p.crypto.ed25519 import create_new_key_pair  # noqa: PLC0415

        return create_new_key_pair(self.private_bytes)

    # Persistence ---------------------------------------------------------------------

    def save(self, path: Path) -> None:
        """Write the key as PKCS8 PEM, created with mode 0600 (never world-readable)."""
        path = Path(path)
        pem = self.private_key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption())
        tmp = path.with_name(path.name + ".tmp")
        try:
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            # O_EXCL after unlinking: never write the key through a planted file or symlink.
            tmp.unlink(missing_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, KEY_FILE_MODE)
            try:
                os.fchmod(fd, KEY_FILE_MODE)
                view = memoryview(pem)
                while view:
                    view = view[os.write(fd, view):]
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except OSError as e:
            raise IdentityError(f"cannot write key file {path}: {e.strerror or e}") from None

    @classmethod
    def load(cls, path: Path) -> Identity:
        path = Path(path)
        try:
            mode = stat.S_IMODE(path.stat().st_mode)
        except FileNotFoundError:
            raise IdentityError(f"key file {path} does not exist (create it with "
                                "`swarm-node keygen`)") from None
        except OSError as e:
            raise IdentityError(f"cannot read key file {path}: {e.strerror}") from None
        if mode & 0o077:
            raise IdentityError(
                f"key file {path} has permissions {mode:04o}; it must be readable by its "
                f"owner only (run: chmod 600 {path})")
        try:
            data = path.read_bytes()
            key = serialization.load_pem_private_key(data, password=None)
        except OSError as e:
            raise IdentityError(f"cannot read key file {path}: {e.strerror}") from None
        except (ValueError, TypeError, UnsupportedAlgorithm) as e:
            raise IdentityError(f"key file {path} is not a valid PEM private key ({e})") from None
        if not isinstance(key, Ed25519PrivateKey):
            raise IdentityError(
                f"key file {path} holds a {type(key).__name__.lstrip('_')}, but swarm-node "
                "needs an Ed25519 key (create one with `swarm-node keygen`)")
        return cls(key)

    @classmethod
    def load_or_create(cls, path: Path) -> Identity:
        path = Path(path)
        if path.exists():
            return cls.load(path)
        ident = cls.generate()
        ident.save(path)
        return ident
