"""Packed binary field types for bus messages.

Token ids, block ids, bitmasks and float arrays travel as little-endian packed bytes (msgpack
`bin`), never as lists of Python ints: a 2,000-token prompt is 8 KB of bytes instead of 2,000
msgpack integers, and decoding is one `numpy.frombuffer`.

In Python the fields hold plain lists (ints or floats) so core logic stays simple; the
conversion happens only at validation (bytes -> list) and serialization (list -> bytes).
A list (or array) given for an integer field is range-checked against its dtype at validation
(int32, int64, uint8): msgpack carries any 64-bit integer, and one out of range would otherwise
pass decoding and only fail when the message that repeats it (a StepPlan) is packed, in the
consumer that trusted it.
"""

from __future__ import annotations

import functools
from typing import Annotated, Any

import numpy as np
from pydantic import PlainSerializer, PlainValidator

INT32_MIN = -(2**31)
INT32_MAX = 2**31 - 1


def _unpacker(dtype: str, itemsize: int, kind: type) -> Any:
    def validate(value: Any) -> list[Any]:
        if isinstance(value, bytes | bytearray | memoryview):
            raw = bytes(value)
            if len(raw) % itemsize:
                raise ValueError(
                    f"packed {dtype} array has {len(raw)} bytes, not a multiple of {itemsize}"
                )
            return np.frombuffer(raw, dtype=dtype).tolist()
        if isinstance(value, np.ndarray):
            if kind is int and value.size and value.dtype.kind in "iu":
                _check_range(dtype, int(value.min()), int(value.max()))
            return value.astype(dtype, copy=False).tolist()
        if isinstance(value, list | tuple):
            if kind is int and all(type(v) is int for v in value):  # the common case, fast
                if value:
                    _check_range(dtype, min(value), max(value))
                return list(value)
            out = []
            for v in value:
                if isinstance(v, bool) or not isinstance(v, int | float | np.integer | np.floating):
                    raise ValueError(f"expected {kind.__name__} items, got {type(v).__name__}")
                if kind is int and not float(v).is_integer():
                    raise ValueError(f"expected int items, got {v!r}")
                out.append(kind(v))
            if kind is int and out:
                _check_range(dtype, min(out), max(out))
            return out
        raise ValueError(f"expected packed bytes or a list, got {type(value).__name__}")

    return validate


@functools.cache
def _int_info(dtype: str) -> np.iinfo:
    return np.iinfo(np.dtype(dtype))  # built once per dtype, not per checked list


def _check_range(dtype: str, low: int, high: int) -> None:
    info = _int_info(dtype)
    if low < info.min or high > info.max:
        bad = low if low < info.min else high
        raise ValueError(f"{bad} does not fit {info.dtype} [{info.min}, {info.max}]")


def _packer(dtype: str) -> Any:
    def serialize(value: list[Any]) -> bytes:
        return np.asarray(value, dtype=dtype).tobytes()

    return serialize


#: int32 array (token ids, block ids, positions) packed as little-endian bytes.
PackedInt32 = Annotated[
    list[int], PlainValidator(_unpacker("<i4", 4, int)), PlainSerializer(_packer("<i4"))
]
#: int64 array (byte counts) packed as little-endian bytes.
PackedInt64 = Annotated[
    list[int], PlainValidator(_unpacker("<i8", 8, int)), PlainSerializer(_packer("<i8"))
]
#: uint8 array (small per-item codes: a status per chunk) packed one byte per item.
PackedUInt8 = Annotated[
    list[int], PlainValidator(_unpacker("<u1", 1, int)), PlainSerializer(_packer("<u1"))
]
#: float32 array (logprobs) packed as little-endian bytes.
PackedFloat32 = Annotated[
    list[float], PlainValidator(_unpacker("<f4", 4, float)), PlainSerializer(_packer("<f4"))
]


def _validate_blob(value: Any) -> bytes:
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value)
    if isinstance(value, np.ndarray):
        return value.tobytes()
    raise ValueError(f"expected bytes, got {type(value).__name__}")


#: Raw bytes (a bitmask already laid out by its producer), passed through unchanged.
Blob = Annotated[bytes, PlainValidator(_validate_blob)]
