"""Wire structs: round trips, strict schemas, tensor validation, size limits."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch
from swarm_node.protocol.codec import pack, unpack
from swarm_node.protocol.errors import MalformedMessage, MessageTooLarge, SchemaViolation
from swarm_node.protocol.limits import DEFAULT_MAX_BYTES, Limits
from swarm_node.protocol.messages import (
    MESSAGE_TYPES,
    CheckpointManifest,
    Completion,
    RolloutBatch,
    SamplingParams,
    TaskRef,
    TensorData,
    Verdict,
    WireModel,
    register_message_type,
)

from .examples import completion, float32s, int32s, valid_messages

EXAMPLES = valid_messages()


def test_every_registered_type_has_an_example_and_a_limit():
    assert set(EXAMPLES) == set(MESSAGE_TYPES)
    assert set(MESSAGE_TYPES) <= set(DEFAULT_MAX_BYTES)


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_round_trip(name):
    msg = EXAMPLES[name]
    data = msg.encode()
    back = MESSAGE_TYPES[name].decode(data)
    assert back == msg
    assert back.encode() == data  # encoding is deterministic
    assert len(data) <= Limits().max_for(name)


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_unknown_field_rejected(name):
    wire = EXAMPLES[name].to_wire()
    wire["extra"] = 1
    with pytest.raises(SchemaViolation, match="extra"):
        MESSAGE_TYPES[name].decode(pack(wire))


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_missing_required_field_rejected(name):
    cls = MESSAGE_TYPES[name]
    required = [f for f, info in cls.model_fields.items() if info.is_required()]
    assert required
    wire = EXAMPLES[name].to_wire()
    del wire[required[0]]
    with pytest.raises(SchemaViolation, match=required[0]):
        cls.decode(pack(wire))


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_decode_over_limit_is_too_large(name):
    data = EXAMPLES[name].encode()
    with pytest.raises(MessageTooLarge):
        MESSAGE_TYPES[name].decode(data, max_size=len(data) - 1)


@pytest.mark.parametrize("value", [pack([1, 2]), pack("x"), pack(None), pack(3)])
def test_non_map_payload_is_schema_violation(value):
    with pytest.raises(SchemaViolation):
        Verdict.decode(value)


def test_strict_types_no_coercion():
    wire = EXAMPLES["verdict"].to_wire()
    for field, bad in [("accept", 1), ("policy_version", True), ("policy_version", "4"),
                       ("policy_version", 4.0), ("subject", b"peer"), ("rollout_id", "x" * 32)]:
        w = dict(wire, **{field: bad})
        with pytest.raises(SchemaViolation, match=field):
            Verdict.decode(pack(w))


@pytest.mark.parametrize("field,bad", [
    ("policy_version", -1), ("policy_version", 2**64), ("rollout_id", b"\x00" * 31),
    ("rollout_id", b"\x00" * 33), ("reason", "r" * 65), ("subject", ""),
])
def test_range_checks(field, bad):
    w = dict(EXAMPLES["verdict"].to_wire(), **{field: bad})
    with pytest.raises(SchemaViolation, match=field):
        Verdict.from_wire(w)  # (2**64 cannot even be packed)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_claimed_reward_must_be_finite(bad):
    wire = dict(completion().to_wire(), claimed_reward=bad)
    with pytest.raises(SchemaViolation, match="claimed_reward"):
        Completion.decode(pack(wire))


def test_sampling_params_ranges():
    for kwargs in [{"temperature": -0.1}, {"temperature": float("nan")}, {"top_p": 0.0},
                   {"top_p": 1.5}, {"max_new_tokens": 0}, {"top_k": -1}]:
        with pytest.raises(ValueError):
            SamplingParams(**kwargs)


def test_task_ref_bounds():
    TaskRef(dataset="rg/basic_arithmetic", params={"a": 1, "b": 0.5, "c": "x", "d": True},
            seed=0, index=2**64 - 1)
    for kwargs in [{"dataset": ""}, {"dataset": "x" * 97}, {"seed": -1},
                   {"params": {"k": float("nan")}}, {"params": {"k": [1]}},
                   {"params": {f"k{i}": i for i in range(33)}}]:
        with pytest.raises(ValueError):
            TaskRef(**{"dataset": "toy/x", "seed": 1, "index": 0, **kwargs})


# Tensors -----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype,shape,nbytes", [
    ("float32", [2, 3], 24), ("int64", [4], 32), ("bfloat16", [5], 10), ("bool", [3], 3),
    ("uint8", [0, 7], 0), ("int8", [], 1),
])
def test_tensor_size_must_match_shape(dtype, shape, nbytes):
    TensorData(dtype=dtype, shape=shape, data=b"\x00" * nbytes)
    with pytest.raises(ValueError, match="needs"):
        TensorData(dtype=dtype, shape=shape, data=b"\x00" * (nbytes + 1))


@pytest.mark.parametrize("wire", [
    {"dtype": "float64", "shape": [1], "data": b"\x00" * 8},
    {"dtype": "object", "shape": [1], "data": b"\x00"},
    {"dtype": "float32", "shape": [-1], "data": b""},
    {"dtype": "float32", "shape": [1] * 9, "data": b"\x00" * 4},
    {"dtype": "float32", "shape": [2**31], "data": b""},
    {"dtype": "float32", "shape": [2**30, 2**30, 2**30], "data": b"\x00" * 4},
    {"dtype": "float32", "shape": [1.0], "data": b"\x00" * 4},
    {"dtype": "float32", "shape": "1", "data": b"\x00" * 4},
    {"dtype": "bool", "shape": [2], "data": b"\x00\x02"},
    {"dtype": "int32", "shape": [1], "data": "abcd"},
])
def test_tensor_bad_wire_rejected(wire):
    with pytest.raises(SchemaViolation):
        TensorData.from_wire(wire)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int64,
                                   torch.int32, torch.int16, torch.int8, torch.uint8,
                                   torch.bool])
def test_tensor_torch_round_trip(dtype):
    src = (torch.arange(24).reshape(2, 3, 4) % 7).to(dtype)
    td = TensorData.from_torch(src.transpose(0, 2))  # non-contiguous input
    back = TensorData.decode(td.encode()).to_torch()
    assert back.dtype == dtype
    assert torch.equal(back, src.transpose(0, 2))


def test_tensor_numpy_round_trip_and_byte_order():
    src = np.arange(6, dtype=">f4").reshape(2, 3)  # big-endian input goes out little-endian
    td = TensorData.from_numpy(src)
    assert td.dtype == "float32"
    assert td.data == np.arange(6, dtype="<f4").tobytes()
    assert np.array_equal(td.to_numpy(), src)
    with pytest.raises(ValueError, match="float64"):
        TensorData.from_numpy(np.zeros(2))


def test_tensor_bytes_are_little_endian():
    td = int32s([1, -2])
    assert td.data == struct.pack("<2i", 1, -2)
    assert td.to_numpy().tolist() == [1, -2]


# Composite checks ---------------------------------------------------------------------


def test_completion_shape_rules():
    base = completion(3).__dict__
    for update, match in [
        ({"logprobs": float32s([0.0] * 2)}, "differ"),
        ({"prompt_ids": float32s([0.0])}, "int32"),
        ({"logprobs": int32s([0, 0, 0])}, "float32"),
        ({"completion_ids": TensorData(dtype="int32", shape=[3, 1], data=b"\x00" * 12)}, "1-D"),
        ({"finish_reason": "stop"}, "finish_reason"),
    ]:
        with pytest.raises(ValueError, match=match):
            Completion(**{**base, **update})


def test_rollout_batch_needs_completions():
    wire = EXAMPLES["rollout_batch"].to_wire()
    wire["completions"] = []
    with pytest.raises(SchemaViolation, match="completions"):
        RolloutBatch.decode(pack(wire))


def test_manifest_layout_rules():
    good = EXAMPLES["checkpoint_manifest"].to_wire()
    assert CheckpointManifest.from_wire(good).num_shards == 3
    assert CheckpointManifest.from_wire(good).shard_range(2) == (8192, 10_240)
    for update, match in [
        ({"total_size": 10_241}, "add up"),
        ({"shard_hashes": good["shard_hashes"][:2]}, "shard hashes"),
        ({"files": [good["files"][0], dict(good["files"][0], size=240)]}, "duplicate"),
        ({"files": [dict(good["files"][0], name="../x")]}, "name"),
        ({"shard_size": 100}, "shard_size"),
        ({"hash_algo": "sha1"}, "hash_algo"),
    ]:
        with pytest.raises(SchemaViolation, match=match):
            CheckpointManifest.from_wire({**good, **update})


def test_register_message_type():
    class Ping(WireModel):
        TYPE = "test_ping_only"
        n: int

    try:
        register_message_type(Ping)
        assert MESSAGE_TYPES["test_ping_only"] is Ping
        with pytest.raises(ValueError):
            register_message_type(Ping)
    finally:
        MESSAGE_TYPES.pop("test_ping_only", None)

    class NoName(WireModel):
        pass

    with pytest.raises(ValueError):
        register_message_type(NoName)


def test_decode_rejects_msgpack_garbage():
    with pytest.raises(MalformedMessage):
        Verdict.decode(b"\xc1")
    with pytest.raises(MalformedMessage):
        Verdict.decode(EXAMPLES["verdict"].encode() + b"\x00")  # trailing bytes
    assert unpack(EXAMPLES["verdict"].encode(), max_size=4096)["accept"] is False
