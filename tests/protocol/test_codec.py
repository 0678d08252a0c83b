"""msgpack codec: total decoding with hard limits."""

from __future__ import annotations

import msgpack
import pytest
from swarm_node.protocol.codec import MAX_DEPTH, pack, tensor_nbytes, unpack
from swarm_node.protocol.errors import MalformedMessage, MessageTooLarge, ProtocolError


def test_round_trip_types():
    value = {"a": [1, -2, 2**63, 1.5, None, True], "b": b"\x00\xff", "c": {"d": "é"}}
    assert unpack(pack(value), max_size=1000) == value


def test_bin_and_str_stay_distinct():
    assert unpack(pack([b"x", "x"]), max_size=100) == [b"x", "x"]


@pytest.mark.parametrize("data", [
    b"", b"\xc1", b"\x92\x01", b"\x01\x02",             # invalid, truncated, trailing
    b"\xa2\xff\xfe",                                     # str that is not UTF-8
    b"\x81\x01\x02",                                     # int map key
    b"\xd6\xff\x00\x00\x00\x01",                         # msgpack timestamp extension
    b"\xd4\x05\x00",                                     # other extension
    b"\xdd\xff\xff\xff\xff",                             # array claiming 4G elements
    b"\xc6\xff\xff\xff\xff",                             # bin claiming 4 GiB
    b"\xdb\x7f\xff\xff\xff" + b"a" * 10,                 # str claiming 2 GiB
])
def test_bad_input_is_malformed(data):
    with pytest.raises(MalformedMessage):
        unpack(data, max_size=1 << 20)


def test_nesting_limit():
    ok = b"\x91" * (MAX_DEPTH - 1) + b"\xc0"
    unpack(ok, max_size=1000)
    with pytest.raises(MalformedMessage, match="nesting|msgpack"):
        unpack(b"\x91" * (MAX_DEPTH + 1) + b"\xc0", max_size=1000)
    with pytest.raises(MalformedMessage):
        unpack(b"\x91" * 100_000 + b"\xc0", max_size=1 << 20)  # msgpack's own stack limit



def test_nesting_limit_behind_scalars():
    """A deep value after many scalars (the scalar-only fast path must not hide it)."""
    deep: list = [None]
    for _ in range(MAX_DEPTH + 1):
        deep = [deep]
    for value in ([*range(1000), deep], {"a": 1, "b": "x", "c": deep}, [[1.5] * 100, deep]):
        with pytest.raises(MalformedMessage, match="nesting"):
            unpack(pack(value), max_size=1 << 20)
    assert unpack(pack([*range(1000), [[1]]]), max_size=1 << 20)[-1] == [[1]]


def test_size_limit():
    data = pack(b"x" * 100)
    assert unpack(data, max_size=len(data)) == b"x" * 100
    with pytest.raises(MessageTooLarge) as e:
        unpack(data, max_size=len(data) - 1)
    assert e.value.reason == "too_large"


@pytest.mark.parametrize("value", ["text", None, 5, [b"x"]])
def test_non_bytes_input(value):
    with pytest.raises(MalformedMessage):
        unpack(value, max_size=100)


def test_bytearray_and_memoryview_accepted():
    data = pack([1, 2])
    assert unpack(bytearray(data), max_size=10) == [1, 2]
    assert unpack(memoryview(data), max_size=10) == [1, 2]


def test_errors_carry_reason_codes():
    with pytest.raises(ProtocolError) as e:
        unpack(b"\xc1", max_size=10)
    assert e.value.reason == "malformed"


def test_pack_is_msgpack():
    assert msgpack.unpackb(pack({"k": [1, b"b"]})) == {"k": [1, b"b"]}


def test_tensor_nbytes():
    assert tensor_nbytes("float32", [2, 3]) == 24
    assert tensor_nbytes("bfloat16", []) == 2
    assert tensor_nbytes("int8", [0, 5]) == 0
    for dtype, shape in [("float64", [1]), ("int32", [-1]), ("int32", [1] * 9),
                         ("int32", [1.5])]:
        with pytest.raises(ValueError):
            tensor_nbytes(dtype, shape)
