"""Signed envelopes: every peer message travels inside one.

Wire form: msgpack array [v, type, sender, ts_ms, nonce, payload, sig].
Signed bytes: DOMAIN + msgpack array [v, type, sender, ts_ms, nonce, payload].
`payload` is the msgpack encoding of the typed message named by `type`.
The signature is Ed25519 by the key embedded in `sender` (an identity-multihash peer ID).
"""

from __future__ import annotations

import os
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cryptography.exceptions import InvalidSignature

from .codec import pack, unpack
from .errors import (
    BadSignature,
    MalformedMessage,
    MessageTooLarge,
    ProtocolError,
    ReplayedMessage,
    SenderMismatch,
    StaleMessage,
    UnknownMessageType,
    UnsupportedVersion,
)
from .limits import Limits
from .messages import MESSAGE_TYPES, WireModel
from .peerid import public_key_from_peer_id

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

ENVELOPE_VERSION = 1
DOMAIN = b"swarm-node/envelope/1\x00"
NONCE_LEN = 16
SIG_LEN = 64
DEFAULT_MAX_SKEW_S = 300.0


@dataclass(frozen=True)
class Envelope:
    type: str
    sender: str
    ts_ms: int
    nonce: bytes
    payload: bytes
    signature: bytes
    message: WireModel

    @property
    def version(self) -> int:
        return self.message.VERSION


def _signed_bytes(v: int, msg_type: str, sender: str, ts_ms: int, nonce: bytes,
                  payload: bytes) -> bytes:
    return DOMAIN + pack([v, msg_type, sender, ts_ms, nonce, payload])


def seal(message: WireModel, key: Ed25519PrivateKey, sender: str, *,
         ts_ms: int | None = None, nonce: bytes | None = None) -> bytes:
    """Encode and sign `message` as `sender` (the peer ID of `key`)."""
    if message.TYPE not in MESSAGE_TYPES:
        raise ValueError(f"{type(message).__name__} is not a registered message type")
    ts_ms = int(time.time() * 1000) if ts_ms is None else ts_ms
    nonce = os.urandom(NONCE_LEN) if nonce is None else nonce
    payload = message.encode()
    v = message.VERSION
    sig = key.sign(_signed_bytes(v, message.TYPE, sender, ts_ms, nonce, payload))
    return pack([v, message.TYPE, sender, ts_ms, nonce, payload, sig])


class ReplayCache:
    """Remembers (sender, nonce) pairs for the skew window; bounded in size."""

    def __init__(self, window_s: float = 2 * DEFAULT_MAX_SKEW_S, max_entries: int = 200_000):
        self.window_s = window_s
        self.max_entries = max_entries
        self._seen: OrderedDict[tuple[str, bytes], float] = OrderedDict()

    def check_and_add(self, sender: str, nonce: bytes, now: float) -> None:
        cutoff = now - self.window_s
        while self._seen and (next(iter(self._seen.values())) < cutoff
                              or len(self._seen) >= self.max_entries):
            self._seen.popitem(last=False)
        key = (sender, nonce)
        if key in self._seen:
            raise ReplayedMessage(f"nonce {nonce.hex()} from {sender} already seen")
        self._seen[key] = now


def open_envelope(
    data: bytes,
    *,
    limits: Limits | None = None,
    expected_type: str | None = None,
    expected_sender: str | None = None,
    max_skew_s: float | None = DEFAULT_MAX_SKEW_S,
    replay_cache: ReplayCache | None = None,
    now: float | None = None,
) -> Envelope:
    """Decode, authenticate and validate one envelope. Any failure is a ProtocolError.

    Checks, in order: size, msgpack shape, version, known type, per-type payload size,
    sender peer ID, signature, expected sender/type, timestamp skew, replay, payload schema.
    """
    limits = limits or Limits()
    raw = unpack(data, max_size=limits.max_envelope())
    if not isinstance(raw, list) or len(raw) != 7:
        raise MalformedMessage("envelope must be a 7-element array")
    v, msg_type, sender, ts_ms, nonce, payload, sig = raw
    if not isinstance(v, int) or isinstance(v, bool):
        raise MalformedMessage("envelope version must be an integer")
    if not isinstance(msg_type, str) or not isinstance(sender, str):
        raise MalformedMessage("envelope type and sender must be strings")
    if not isinstance(ts_ms, int) or isinstance(ts_ms, bool) or not 0 <= ts_ms < 2**63:
        raise MalformedMessage("envelope timestamp must be a non-negative integer")
    if not isinstance(nonce, bytes) or len(nonce) != NONCE_LEN:
        raise MalformedMessage(f"envelope nonce must be {NONCE_LEN} bytes")
    if not isinstance(payload, bytes) or not isinstance(sig, bytes) or len(sig) != SIG_LEN:
        raise MalformedMessage("envelope payload must be bytes and signature 64 bytes")
    cls = MESSAGE_TYPES.get(msg_type)
    if cls is None:
        raise UnknownMessageType(f"unknown message type {msg_type[:64]!r}")
    if v != cls.VERSION:
        raise UnsupportedVersion(f"{msg_type} schema version {v} (this node speaks {cls.VERSION})")
    if len(payload) > limits.max_for(msg_type):
        raise MessageTooLarge(
            f"{msg_type} payload of {len(payload)} bytes exceeds {limits.max_for(msg_type)}")
    key = public_key_from_peer_id(sender)
    try:
        key.verify(sig, _signed_bytes(v, msg_type, sender, ts_ms, nonce, payload))
    except InvalidSignature:
        raise BadSignature(f"{msg_type} from {sender}: signature does not verify") from None
    if expected_sender is not None and sender != expected_sender:
        raise SenderMismatch(f"signed by {sender}, but arrived from {expected_sender}")
    if expected_type is not None and msg_type != expected_type:
        raise UnknownMessageType(f"expected {expected_type}, got {msg_type}")
    now = time.time() if now is None else now
    if replay_cache is not None:
        # A nonce is remembered for window_s; accepting only timestamps within half of that
        # means a message replayed after it is forgotten is always stale.
        half = replay_cache.window_s / 2
        max_skew_s = half if max_skew_s is None else min(max_skew_s, half)
    if max_skew_s is not None and abs(now - ts_ms / 1000) > max_skew_s:
        raise StaleMessage(f"timestamp {ts_ms} is more than {max_skew_s:.0f}s from now")
    message = cls.decode(payload, max_size=limits.max_for(msg_type))
    if replay_cache is not None:
        replay_cache.check_and_add(sender, nonce, now)
    return Envelope(msg_type, sender, ts_ms, nonce, payload, sig, message)


def peek_sender(data: bytes) -> str | None:
    """The unauthenticated sender field, for logging/counting only; None if unreadable."""
    try:
        raw = unpack(data, max_size=Limits().max_envelope())
    except ProtocolError:
        return None
    if isinstance(raw, list) and len(raw) == 7 and isinstance(raw[2], str):
        return raw[2][:128]
    return None
