"""msgpack encoding with hard limits, and tensors as {dtype, shape, data}.

`unpack` is total: any byte string gives a Python value or a `ProtocolError`. msgpack's own
length caps are set from the input size, so a hostile length prefix cannot make it allocate
more than the input allows.
"""

from __future__ import annotations

import math
from typing import Any

import msgpack

from .errors import MalformedMessage, MessageTooLarge

MAX_DEPTH = 32


def pack(obj: Any) -> bytes:
    """Canonical msgpack: binary as bin, str as str, maps in insertion order."""
    return msgpack.packb(obj, use_bin_type=True)


def _no_ext(code: int, data: bytes) -> Any:
    raise MalformedMessage(f"msgpack extension type {code} is not allowed")


def unpack(data: bytes, *, max_size: int) -> Any:
    """Decode one msgpack value of at most `max_size` bytes."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise MalformedMessage(f"expected bytes, got {type(data).__name__}")
    size = len(data)
    if size > max_size:
        raise MessageTooLarge(f"message of {size} bytes exceeds the limit of {max_size}")
    try:
        value = msgpack.unpackb(
            bytes(data),
            raw=False,
            strict_map_key=True,
            use_list=True,
            ext_hook=_no_ext,
            max_str_len=size,
            max_bin_len=size,
            max_array_len=size,
            max_map_len=size,
            max_ext_len=0,
        )
    except MalformedMessage:
        raise
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError,
            msgpack.StackError, UnicodeDecodeError, OverflowError, RecursionError) as e:
        raise MalformedMessage(f"invalid msgpack: {type(e).__name__}: {e}") from None
    if _depth(value) > MAX_DEPTH:
        raise MalformedMessage(f"nesting deeper than {MAX_DEPTH}")
    return value


_SCALARS = frozenset({int, float, str, bytes, bool, type(None)})


def _depth(value: Any, level: int = 0) -> int:
    """Nesting depth of containers (a scalar: `level`), stopping past MAX_DEPTH. Only
    containers are recursed into, and a container of scalars only (a list of token ids) is
    recognised by its set of item types, without a Python step per item."""
    if level > MAX_DEPTH:
        return level
    if isinstance(value, dict):
        items = value.values()
    elif isinstance(value, list):
        items = value
    else:
        return level
    deepest = level + 1
    if set(map(type, items)) <= _SCALARS:
        return deepest
    for v in items:
        if isinstance(v, (dict, list)):
            deepest = max(deepest, _depth(v, level + 1))
            if deepest > MAX_DEPTH:
                break
    return deepest


# Tensors -------------------------------------------------------------------------------

DTYPE_SIZES = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}
MAX_TENSOR_NDIM = 8


def tensor_nbytes(dtype: str, shape: list[int] | tuple[int, ...]) -> int:
    """Byte size of a dense tensor; raises ValueError for unknown dtypes or bad shapes."""
    if dtype not in DTYPE_SIZES:
        raise ValueError(f"unsupported dtype {dtype!r}")
    if len(shape) > MAX_TENSOR_NDIM or any((not isinstance(d, int)) or d < 0 for d in shape):
        raise ValueError(f"bad shape {shape!r}")
    return DTYPE_SIZES[dtype] * math.prod(shape)
