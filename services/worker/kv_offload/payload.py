"""The Redis payload of one offload chunk: a header, then every layer's K and V contiguously.

One chunk is one KV cache block of one group. Its payload is a single Redis value, so a load is
one read per chunk and a store one SET (a payload exists completely or not at all):

    magic "MLKV" | u16 layout version | u8 dtype code | u8 ndim (5) | u16 model-name length |
    u32 x 5 shape [layers, 2, block_size, kv_heads, head_dim] | model name (UTF-8) | body

all little-endian; the body is the raw tensor bytes in that shape (index 1 of the second axis:
0 = K, 1 = V), `prod(shape) * itemsize` bytes exactly.

A chunk of a state group (a hybrid model's Mamba layers, moved by P/D only: shared/kv/groups.py)
has the same header with the shape `[layers, 1, 1, 1, state_elems]`: per state layer (ascending
layer index) the state-pool block's conv state `[conv_dim, d_conv - 1]` flattened, then its SSM
state `[n_heads, head_dim, d_state]` flattened, `state_elems = conv_dim * (d_conv - 1) + n_heads *
head_dim * d_state`, in the state pool's dtype (group_blocks.py packs and unpacks it).

The key names carry the model and `LAYOUT_VERSION` too (`shared.kv.offload_key.KeySpace`),
so different models or layouts never even address each other's values; the header is the second
line of defence (a key written by a misconfigured worker, a truncated value) and it is checked
on every load: any mismatch fails that chunk, never a silently wrong KV cache.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import torch

# One constant for the key names and the header: it lives with the key space (which the
# scheduler and kvstore import without torch). Bump it whenever the body layout or this header
# changes: old payloads then become unreachable by name and refused by header.
from shared.kv.offload_key import LAYOUT_VERSION

__all__ = [
    "LAYOUT_VERSION",
    "PayloadError",
    "PayloadHeader",
    "check_payload",
    "pack_payload",
    "read_header",
]

MAGIC = b"MLKV"
_FIXED = struct.Struct("<4sHBBH5I")  # magic, version, dtype, ndim, model length, shape

DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 1,
    torch.float16: 2,
    torch.bfloat16: 3,
    torch.float8_e4m3fn: 4,
    torch.float8_e5m2: 5,
}
_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}


class PayloadError(ValueError):
    """A payload that is malformed or does not belong to the reader (reason in the message)."""


@dataclass(frozen=True, slots=True)
class PayloadHeader:
    """What a chunk payload claims to be; a reader compares it with what it expects."""

    model: str
    dtype: torch.dtype
    # [layers, 2, block_size, kv_heads, head_dim]; a state chunk [layers, 1, 1, 1, state_elems]
    shape: tuple[int, int, int, int, int]
    layout_version: int = LAYOUT_VERSION

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_CODES:
            raise PayloadError(f"dtype {self.dtype} has no payload code")
        kv = len(self.shape) == 5 and self.shape[1] == 2
        state = len(self.shape) == 5 and tuple(self.shape[1:4]) == (1, 1, 1)
        if not (kv or state) or min(self.shape) < 1:
            raise PayloadError(
                "shape must be [layers, 2, block, heads, dim] or [layers, 1, 1, 1, state_elems], "
                f"got {self.shape}"
            )

    @property
    def body_bytes(self) -> int:
        n = 1
        for dim in self.shape:
            n *= dim
        return n * torch.empty((), dtype=self.dtype).element_size()

    def encode(self) -> bytes:
        name = self.model.encode()
        fixed = _FIXED.pack(
            MAGIC, self.layout_version, DTYPE_CODES[self.dtype], 5, len(name), *self.shape
        )
        return fixed + name


def pack_payload(header: PayloadHeader, body: torch.Tensor) -> bytes:
    """Header + the raw bytes of `body` (a contiguous host tensor of the header's shape/dtype)."""
    if tuple(body.shape) != header.shape or body.dtype != header.dtype:
        raise PayloadError(
            f"body {tuple(body.shape)} {body.dtype} does not match header {header.shape} "
            f"{header.dtype}"
        )
    if body.device.type != "cpu" or not body.is_contiguous():
        raise PayloadError("the body must be a contiguous host tensor")
    raw = body.view(torch.uint8).numpy()  # a uint8 view: numpy has no bfloat16 or fp8
    return b"".join((header.encode(), raw.data))


def read_header(payload: bytes, layout_version: int = LAYOUT_VERSION) -> tuple[PayloadHeader, int]:
    """The header of `payload` and the offset where its body starts; checks the body length.
    The layout version is checked before anything after it is parsed: another layout may
    place everything after it differently."""
    if len(payload) < _FIXED.size:
        raise PayloadError(f"payload of {len(payload)} bytes is shorter than a header")
    magic, version, code, ndim, name_len, *shape = _FIXED.unpack_from(payload)
    if magic != MAGIC:
        raise PayloadError(f"bad magic {magic!r}")
    if version != layout_version:
        raise PayloadError(
            f"layout_version mismatch: payload has {version}, expected {layout_version}"
        )
    if ndim != 5:
        raise PayloadError(f"header has {ndim} dimensions, expected 5")
    if code not in _DTYPES:
        raise PayloadError(f"unknown dtype code {code}")
    start = _FIXED.size + name_len
    try:
        model = payload[_FIXED.size : start].decode()
    except UnicodeDecodeError:
        raise PayloadError("model name is not UTF-8") from None
    header = PayloadHeader(model, _DTYPES[code], tuple(shape), version)  # type: ignore[arg-type]
    if len(payload) - start != header.body_bytes:
        raise PayloadError(
            f"body has {len(payload) - start} bytes, the header says {header.body_bytes}"
        )
    return header, start


def check_payload(payload: bytes, expected: PayloadHeader) -> int:
    """Offset of the body of `payload` if its header equals `expected`, else PayloadError
    naming the first field that differs."""
    header, start = read_header(payload, expected.layout_version)
    for field in ("model", "dtype", "shape"):
        got, want = getattr(header, field), getattr(expected, field)
        if got != want:
            raise PayloadError(f"{field} mismatch: payload has {got!r}, expected {want!r}")
    return start
