"""Hypothesis fuzzing of every decoder: any input gives a valid value or a ProtocolError.

Inputs: random bytes, byte-level mutations of valid encodings, and structure-level mutations
(a field of a valid message replaced by a random msgpack value), the latter also inside a
correctly signed envelope so that the schema checks behind the signature are reached.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from swarm_node.protocol.codec import pack, unpack
from swarm_node.protocol.envelope import NONCE_LEN, ReplayCache, open_envelope, peek_sender
from swarm_node.protocol.errors import ProtocolError
from swarm_node.protocol.messages import (
    MESSAGE_TYPES,
    Completion,
    SamplingParams,
    TaskRef,
    TensorData,
)
from swarm_node.protocol.peerid import public_key_from_peer_id

from .examples import completion, valid_messages
from .test_envelope import NOW, TS, forge

EXAMPLES = valid_messages()
NAMES = sorted(EXAMPLES)
FUZZ = settings(max_examples=80, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# Every decoder, by name: bytes -> value. Nested structs are decoders too.
NESTED = {
    "tensor": (TensorData, TensorData(dtype="int32", shape=[2], data=b"\x00" * 8)),
    "task_ref": (TaskRef, completion().task),
    "sampling": (SamplingParams, SamplingParams()),
    "completion": (Completion, completion()),
}
DECODERS = {name: MESSAGE_TYPES[name].decode for name in NAMES}
DECODERS.update({name: cls.decode for name, (cls, _) in NESTED.items()})
VALID = {name: EXAMPLES[name].encode() for name in NAMES}
VALID.update({name: ex.encode() for name, (_, ex) in NESTED.items()})
DECODERS["envelope"] = lambda data: open_envelope(data, now=NOW, replay_cache=ReplayCache())
VALID["envelope"] = forge()
DECODERS["unpack"] = lambda data: unpack(data, max_size=1 << 20)
VALID["unpack"] = VALID["rollout_batch"]


def decode_totally(name: str, data: bytes):
    """Run one decoder; only ProtocolError may escape (anything else fails the test)."""
    try:
        value = DECODERS[name](data)
    except ProtocolError as e:
        assert isinstance(e.reason, str) and e.reason
        return None
    if hasattr(value, "encode") and name not in ("envelope", "unpack"):
        # Whatever is accepted is a well-formed message that survives a round trip.
        assert type(value).decode(value.encode(), max_size=1 << 30) == value
    return value


@st.composite
def mutated(draw, data: bytes) -> bytes:
    buf = bytearray(data)
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "set", "insert", "delete", "truncate", "dup"]))
        if not buf:
            buf += draw(st.binary(min_size=1, max_size=8))
            continue
        i = draw(st.integers(0, len(buf) - 1))
        if op == "flip":
            buf[i] ^= 1 << draw(st.integers(0, 7))
        elif op == "set":
            buf[i] = draw(st.sampled_from([0x00, 0x7F, 0x80, 0xC0, 0xC1, 0xCC, 0xCF, 0xD3,
                                          0xDC, 0xDD, 0xDE, 0xDF, 0xFF]))
        elif op == "insert":
            buf[i:i] = draw(st.binary(min_size=1, max_size=8))
        elif op == "delete":
            del buf[i:i + draw(st.integers(1, 8))]
        elif op == "truncate":
            del buf[i:]
        else:
            buf[i:i] = buf[i:i + draw(st.integers(1, 16))]
    return bytes(buf)


msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=20)
    | st.binary(max_size=40),
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


@st.composite
def replaced_field(draw, value):
    """`value` (a decoded wire tree) with one node, possibly nested, replaced."""
    if isinstance(value, dict) and value and draw(st.booleans()):
        key = draw(st.sampled_from(sorted(value)))
        if draw(st.integers(0, 9)) == 0:  # sometimes drop it or add a stranger
            out = dict(value)
            if draw(st.booleans()):
                del out[key]
            else:
                out[draw(st.text(max_size=8))] = draw(msgpack_values)
            return out
        return {**value, key: draw(replaced_field(value[key]))}
    if isinstance(value, list) and value and draw(st.booleans()):
        i = draw(st.integers(0, len(value) - 1))
        return value[:i] + [draw(replaced_field(value[i]))] + value[i + 1:]
    return draw(msgpack_values)


@pytest.mark.parametrize("name", sorted(DECODERS))
@FUZZ
@given(data=st.binary(max_size=1024))
def test_random_bytes(name, data):
    decode_totally(name, data)


@pytest.mark.parametrize("name", sorted(DECODERS))
@FUZZ
@given(st.data())
def test_mutated_valid_bytes(name, data):
    decode_totally(name, data.draw(mutated(VALID[name])))


@pytest.mark.parametrize("name", sorted(set(NAMES) | set(NESTED)))
@FUZZ
@given(st.data())
def test_mutated_fields(name, data):
    wire = unpack(VALID[name], max_size=1 << 20)
    decode_totally(name, pack(data.draw(replaced_field(wire))))


@pytest.mark.parametrize("name", NAMES)
@settings(FUZZ, max_examples=40)
@given(st.data())
def test_mutated_fields_behind_valid_signature(name, data):
    wire = unpack(VALID[name], max_size=1 << 20)
    payload = pack(data.draw(replaced_field(wire)))
    try:
        env = open_envelope(forge(name, payload), now=NOW)
    except ProtocolError:
        return
    assert env.message.encode() == payload or type(env.message).decode(payload) == env.message


@FUZZ
@given(st.lists(msgpack_values, min_size=0, max_size=8))
def test_random_envelope_fields(fields):
    decode_totally("envelope", pack(fields))
    sender = peek_sender(pack(fields))
    assert sender is None or (isinstance(sender, str) and sender == fields[2][:128])


@FUZZ
@given(st.integers(0, 6), msgpack_values)
def test_one_envelope_field_replaced(index, value):
    fields = [1, "verdict", EXAMPLES["verdict"].subject, TS, b"n" * NONCE_LEN,
              VALID["verdict"], b"s" * 64]
    fields[index] = value
    decode_totally("envelope", pack(fields))


@FUZZ
@given(st.text(max_size=140) | st.binary(max_size=60) | st.integers() | st.none())
def test_peer_id_parser(value):
    try:
        public_key_from_peer_id(value)
    except ProtocolError:
        pass
