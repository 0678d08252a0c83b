"""Signed envelopes: authenticity, tampering, replay, clock skew, types, versions, sizes."""

from __future__ import annotations

import time

import pytest
from swarm_node.protocol.codec import pack, unpack
from swarm_node.protocol.envelope import (
    DOMAIN,
    NONCE_LEN,
    ReplayCache,
    _signed_bytes,
    open_envelope,
    peek_sender,
    seal,
)
from swarm_node.protocol.errors import (
    BadPeerId,
    BadSignature,
    MalformedMessage,
    MessageTooLarge,
    ProtocolError,
    ReplayedMessage,
    SchemaViolation,
    SenderMismatch,
    StaleMessage,
    UnknownMessageType,
    UnsupportedVersion,
)
from swarm_node.protocol.limits import ENVELOPE_OVERHEAD, Limits
from swarm_node.protocol.messages import MESSAGE_TYPES, WireModel

from .examples import IDENTITY, OTHER, PEER, valid_messages

EXAMPLES = valid_messages()
NOW = 1_800_000_000.0
TS = int(NOW * 1000)


def forge(msg_type="verdict", payload=None, *, v=1, sender=PEER, ts_ms=TS,
          nonce=b"n" * NONCE_LEN, key=IDENTITY.private_key, sig=None) -> bytes:
    """An envelope with any field chosen freely, signed by `key` unless `sig` is given."""
    payload = EXAMPLES["verdict"].encode() if payload is None else payload
    if sig is None:
        sig = key.sign(_signed_bytes(v, msg_type, sender, ts_ms, nonce, payload))
    return pack([v, msg_type, sender, ts_ms, nonce, payload, sig])


def fields(data: bytes) -> list:
    return unpack(data, max_size=1 << 30)


def opened(data: bytes, **kw):
    return open_envelope(data, now=NOW, **kw)


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_seal_open_round_trip(name):
    msg = EXAMPLES[name]
    data = seal(msg, IDENTITY.private_key, PEER, ts_ms=TS)
    env = opened(data, expected_sender=PEER, expected_type=name)
    assert env.message == msg
    assert (env.type, env.sender, env.ts_ms, env.version) == (name, PEER, TS, msg.VERSION)
    assert len(env.nonce) == NONCE_LEN and len(env.signature) == 64
    assert len(data) <= len(msg.encode()) + ENVELOPE_OVERHEAD


def test_identity_seal_uses_its_peer_id():
    env = open_envelope(IDENTITY.seal(EXAMPLES["hello"]))
    assert env.sender == IDENTITY.peer_id
    assert abs(env.ts_ms / 1000 - time.time()) < 60


def test_wire_form_and_signed_bytes():
    data = seal(EXAMPLES["verdict"], IDENTITY.private_key, PEER, ts_ms=TS,
                nonce=b"\x01" * NONCE_LEN)
    v, t, sender, ts, nonce, payload, sig = fields(data)
    assert (v, t, sender, ts, nonce) == (1, "verdict", PEER, TS, b"\x01" * NONCE_LEN)
    assert payload == EXAMPLES["verdict"].encode()
    signed = DOMAIN + pack([v, t, sender, ts, nonce, payload])
    IDENTITY.private_key.public_key().verify(sig, signed)  # raises if not


# Tampering ------------------------------------------------------------------------------


def test_every_payload_byte_flip_is_detected():
    good = forge()
    payload = fields(good)[5]
    for i in range(len(payload)):
        f = fields(good)
        f[5] = payload[:i] + bytes([payload[i] ^ 0x01]) + payload[i + 1:]
        with pytest.raises(BadSignature):
            opened(pack(f))


@pytest.mark.parametrize("index,value", [
    (2, OTHER.peer_id),                       # sender swapped for another valid peer
    (3, TS + 1),                              # timestamp
    (4, b"m" * NONCE_LEN),                    # nonce
    (1, "status"),                            # type (to another known type)
])
def test_tampered_header_field_is_detected(index, value):
    f = fields(forge())
    f[index] = value
    with pytest.raises(BadSignature):
        opened(pack(f))


def test_signature_bit_flip_is_detected():
    f = fields(forge())
    f[6] = bytes([f[6][0] ^ 0x80]) + f[6][1:]
    with pytest.raises(BadSignature):
        opened(pack(f))


def test_key_swap_is_detected():
    # Signed with OTHER's key while claiming to be PEER.
    with pytest.raises(BadSignature) as e:
        opened(forge(key=OTHER.private_key))
    assert e.value.reason == "bad_signature"


def test_resigned_by_other_peer_is_sender_mismatch():
    data = forge(sender=OTHER.peer_id, key=OTHER.private_key)
    assert opened(data).sender == OTHER.peer_id
    with pytest.raises(SenderMismatch):
        opened(data, expected_sender=PEER)


def test_signature_without_domain_is_rejected():
    payload = EXAMPLES["verdict"].encode()
    nonce = b"n" * NONCE_LEN
    bare = pack([1, "verdict", PEER, TS, nonce, payload])
    with pytest.raises(BadSignature):
        opened(forge(sig=IDENTITY.sign(bare)))


@pytest.mark.parametrize("sender", ["not-a-peer-id", "Qm" + "1" * 44, ""])
def test_bad_sender_peer_id(sender):
    with pytest.raises(BadPeerId):
        opened(forge(sender=sender))


# Replay, skew ------------------------------------------------------------------------


def test_replayed_nonce_is_detected():
    cache = ReplayCache()
    data = forge()
    opened(data, replay_cache=cache)
    with pytest.raises(ReplayedMessage) as e:
        opened(data, replay_cache=cache)
    assert e.value.reason == "replay"
    opened(forge(nonce=b"o" * NONCE_LEN), replay_cache=cache)  # a fresh nonce is fine
    # The same nonce from another sender is another message.
    opened(forge(sender=OTHER.peer_id, key=OTHER.private_key), replay_cache=cache)


def test_replay_cache_forgets_after_window_and_is_bounded():
    cache = ReplayCache(window_s=10, max_entries=3)
    cache.check_and_add("a", b"1", now=0)
    with pytest.raises(ReplayedMessage):
        cache.check_and_add("a", b"1", now=5)
    cache.check_and_add("a", b"1", now=11)  # forgotten after the window
    for n in range(10):
        cache.check_and_add("b", bytes([n]), now=12)
    assert len(cache._seen) <= 3


def test_invalid_message_does_not_consume_nonce():
    cache = ReplayCache()
    bad = forge(payload=pack({"not": "a verdict"}))
    with pytest.raises(SchemaViolation):
        opened(bad, replay_cache=cache)
    opened(forge(), replay_cache=cache)  # same nonce, now valid: accepted


@pytest.mark.parametrize("offset_s", [-301, 301, -10**6])
def test_stale_timestamp(offset_s):
    data = forge(ts_ms=TS + offset_s * 1000)
    with pytest.raises(StaleMessage) as e:
        opened(data)
    assert e.value.reason == "stale"
    opened(data, max_skew_s=None)  # skew check can be disabled
    opened(data, max_skew_s=abs(offset_s) + 1)


def test_timestamp_inside_window_accepted():
    opened(forge(ts_ms=TS - 299_000))
    opened(forge(ts_ms=TS + 299_000))


# Types, versions, sizes, shape --------------------------------------------------------


def test_unknown_type():
    with pytest.raises(UnknownMessageType) as e:
        opened(forge(msg_type="launch_missiles"))
    assert e.value.reason == "unknown_type"


@pytest.mark.parametrize("v", [0, 2, 99])
def test_unknown_version(v):
    with pytest.raises(UnsupportedVersion) as e:
        opened(forge(v=v))
    assert e.value.reason == "unknown_version"


def test_expected_type_mismatch():
    with pytest.raises(UnknownMessageType):
        opened(forge(), expected_type="hello")


def test_seal_refuses_unregistered_type():
    class Loose(WireModel):
        x: int = 1

    with pytest.raises(ValueError):
        seal(Loose(), IDENTITY.private_key, PEER)


def test_payload_over_type_limit():
    limits = Limits({**Limits().max_bytes, "verdict": 50})
    with pytest.raises(MessageTooLarge) as e:
        opened(forge(), limits=limits)
    assert e.value.reason == "too_large"
    big = pack({"x": b"\x00" * 5000})  # over the 4 KiB default for verdicts
    with pytest.raises(MessageTooLarge):
        opened(forge(payload=big))


def test_envelope_over_total_limit():
    limits = Limits({"verdict": 200})
    data = forge(payload=b"\x00" * 800)
    assert len(data) > limits.max_envelope()
    with pytest.raises(MessageTooLarge):
        opened(data, limits=limits)


def test_schema_violation_inside_signed_envelope():
    wire = dict(EXAMPLES["verdict"].to_wire(), accept="yes")
    with pytest.raises(SchemaViolation, match="accept"):
        opened(forge(payload=pack(wire)))


@pytest.mark.parametrize("raw", [
    [1, "verdict", PEER, TS, b"n" * 16, b"", b"s" * 64, "extra"],   # 8 elements
    [1, "verdict", PEER, TS, b"n" * 16, b""],                       # 6 elements
    {"v": 1},                                                       # not an array
    [True, "verdict", PEER, TS, b"n" * 16, b"", b"s" * 64],          # bool version
    ["1", "verdict", PEER, TS, b"n" * 16, b"", b"s" * 64],           # str version
    [1, b"verdict", PEER, TS, b"n" * 16, b"", b"s" * 64],            # bin type
    [1, "verdict", PEER, -1, b"n" * 16, b"", b"s" * 64],             # negative timestamp
    [1, "verdict", PEER, 1.5, b"n" * 16, b"", b"s" * 64],            # float timestamp
    [1, "verdict", PEER, TS, b"n" * 15, b"", b"s" * 64],             # short nonce
    [1, "verdict", PEER, TS, "n" * 16, b"", b"s" * 64],              # str nonce
    [1, "verdict", PEER, TS, b"n" * 16, "", b"s" * 64],              # str payload
    [1, "verdict", PEER, TS, b"n" * 16, b"", b"s" * 63],             # short signature
])
def test_malformed_envelopes(raw):
    with pytest.raises(MalformedMessage):
        opened(pack(raw))


def test_peek_sender_never_raises():
    assert peek_sender(forge()) == PEER
    assert peek_sender(b"\xc1") is None
    assert peek_sender(pack([1, 2])) is None


def test_all_errors_are_protocol_errors_with_distinct_reasons():
    from swarm_node.protocol import errors

    classes = [c for c in vars(errors).values()
               if isinstance(c, type) and issubclass(c, ProtocolError)]
    reasons = [c.reason for c in classes]
    assert len(set(reasons)) == len(reasons) >= 11
    assert set(MESSAGE_TYPES) == set(EXAMPLES)


def test_replay_window_bounds_the_accepted_skew():
    # With a 10 s replay memory, a message more than 5 s from now is stale even when the
    # caller allows more skew, so nothing can be replayed after its nonce is forgotten.
    cache = ReplayCache(window_s=10)
    data = forge(ts_ms=TS - 4_000)
    open_envelope(data, now=NOW, replay_cache=cache, max_skew_s=None)
    for later in (6, 11, 100):
        with pytest.raises((StaleMessage, ReplayedMessage)):
            open_envelope(data, now=NOW + later, replay_cache=cache, max_skew_s=1000)
    with pytest.raises(StaleMessage):
        open_envelope(forge(ts_ms=TS - 6_000, nonce=b"q" * NONCE_LEN), now=NOW,
                      replay_cache=ReplayCache(window_s=10), max_skew_s=None)
