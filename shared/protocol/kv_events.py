"""Scheduler -> gateways: which prefix blocks a worker group holds, for KV-aware routing."""

from __future__ import annotations

from pydantic import Field

from shared.kv.block_hash import HASH_BYTES
from shared.protocol.base import Message, register
from shared.protocol.packed import Blob


def pack_hashes(hashes: list[bytes]) -> bytes:
    """Block hashes laid end to end (each HASH_BYTES long): one msgpack bin, not a list."""
    return b"".join(hashes)


def unpack_hashes(blob: bytes) -> list[bytes]:
    if len(blob) % HASH_BYTES:
        raise ValueError(f"{len(blob)} bytes is not a whole number of {HASH_BYTES}-byte hashes")
    return [blob[i : i + HASH_BYTES] for i in range(0, len(blob), HASH_BYTES)]


@register
class KVEvents(Message):
    """The prefix blocks (chained block hashes of KV group 0, shared.kv.block_hash) a group's
    scheduler registered in (`stored`) or evicted from (`removed`) its prefix cache since its
    last batch; sent once per step that changed any.

    `snapshot`: `stored` is everything the group holds now and replaces what a reader knew of
    it (sent at start and every `kv_snapshot_interval_s`, so a gateway that starts, or missed
    events, catches up). A new `incarnation` means a restarted scheduler, whose cache is empty:
    a reader drops what it knew of the group's previous process."""

    TYPE = "kv_events"
    VERSION = 1

    group: str
    scheduler_id: str
    incarnation: str
    block_size: int = Field(ge=1)
    snapshot: bool = False
    stored: Blob = b""
    removed: Blob = b""
    time: float = 0.0
