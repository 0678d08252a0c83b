"""Every failure to decode or authenticate peer data is a `ProtocolError` with a reason code.

The reason codes are stable strings: they label metrics, verdicts and logs, and NODE_SPEC.md
lists them.
"""


class ProtocolError(Exception):
    """Root of all wire errors. `reason` is a short stable code."""

    reason = "protocol_error"

    def __init__(self, message: str, *, reason: str | None = None):
        super().__init__(message)
        if reason is not None:
            self.reason = reason


class MalformedMessage(ProtocolError):
    """The bytes are not valid msgpack, or not the expected shape."""

    reason = "malformed"


class MessageTooLarge(ProtocolError):
    """The message exceeds the configured size limit for its type."""

    reason = "too_large"


class SchemaViolation(ProtocolError):
    """A field is missing, of the wrong type, or out of range."""

    reason = "bad_schema"


class UnknownMessageType(ProtocolError):
    """The envelope names a message type this node does not know."""

    reason = "unknown_type"


class UnsupportedVersion(ProtocolError):
    """The envelope or message carries a schema version this node does not speak."""

    reason = "unknown_version"


class BadSignature(ProtocolError):
    """The Ed25519 signature does not verify against the sender's key."""

    reason = "bad_signature"


class BadPeerId(ProtocolError):
    """The sender field is not a valid Ed25519 libp2p peer ID."""

    reason = "bad_peer_id"


class SenderMismatch(ProtocolError):
    """The signed sender is not the peer the message arrived from (or should come from)."""

    reason = "sender_mismatch"


class StaleMessage(ProtocolError):
    """The timestamp is outside the accepted clock-skew window."""

    reason = "stale"


class ReplayedMessage(ProtocolError):
    """The (sender, nonce) pair was seen before inside the replay window."""

    reason = "replay"
