"""msgpack encoding of bus messages: strict, versioned, size-limited.

Envelope: a msgpack map {"t": TYPE, "v": VERSION, "b": body}. Decoding checks, in order: size,
msgpack well-formedness, envelope shape, known type, matching version, then the pydantic model
(extra fields forbidden). Every failure raises CodecError with a reason fit for a dead-letter
record.
"""

from __future__ import annotations

from typing import Any, TypeVar

import msgpack
from pydantic import ValidationError

from shared.protocol import MESSAGE_TYPES, Message

MAX_MESSAGE_BYTES = 64 * 1024 * 1024

M = TypeVar("M", bound=Message)


class CodecError(ValueError):
    """A message that cannot be decoded; `reason` is a short machine-friendly cause."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


def encode(msg: Message) -> bytes:
    # Defaults are left out: both ends share the protocol code, so they fill them back in.
    body = msg.model_dump(mode="python", exclude_defaults=True)
    data = msgpack.packb({"t": msg.TYPE, "v": msg.VERSION, "b": body}, use_bin_type=True)
    if len(data) > MAX_MESSAGE_BYTES:
        raise CodecError("oversized", f"{msg.TYPE} encodes to {len(data)} bytes")
    return data


def decode(data: bytes, expected: type[M] | None = None, max_bytes: int = MAX_MESSAGE_BYTES) -> M:
    if not isinstance(data, bytes | bytearray | memoryview):
        raise CodecError("not_bytes", f"got {type(data).__name__}")
    if len(data) > max_bytes:
        raise CodecError("oversized", f"{len(data)} bytes > limit {max_bytes}")
    try:
        envelope: Any = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except (msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, ValueError) as exc:
        raise CodecError("malformed", f"not valid msgpack ({exc})") from None
    except Exception as exc:  # msgpack raises a handful of types on truncated input
        raise CodecError("malformed", f"not valid msgpack ({type(exc).__name__}: {exc})") from None
    if not isinstance(envelope, dict) or set(envelope) != {"t", "v", "b"}:
        raise CodecError("bad_envelope", "expected a map with keys t, v, b")
    type_tag, version, body = envelope["t"], envelope["v"], envelope["b"]
    cls = MESSAGE_TYPES.get(type_tag) if isinstance(type_tag, str) else None
    if cls is None:
        raise CodecError("unknown_type", f"message type {type_tag!r} is not known")
    if expected is not None and cls is not expected:
        raise CodecError("unexpected_type", f"got {type_tag!r}, expected {expected.TYPE!r}")
    if version != cls.VERSION:
        raise CodecError("bad_version", f"{type_tag} version {version!r}, expected {cls.VERSION}")
    if not isinstance(body, dict):
        raise CodecError("bad_envelope", "body is not a map")
    try:
        return cls.model_validate(body)  # type: ignore[return-value]
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise CodecError("invalid", f"{type_tag}.{where}: {first.get('msg')}") from None
