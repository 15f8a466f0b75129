"""Scheduler -> kvstore calls (shared.rpc): the offload tier's lifecycle, one message per step.

`store` (reserve room; the answer says which chunks to write), `writing` (their step ended:
the write deadline restarts), `stored` (writes done or failed), `load` (pin ready chunks for a
read), `loaded` (release those pins), `request_finished` (the request's one recency access),
plus `lookup` (status per chunk) and `stats`. The lifecycle itself is CONTRACTS.md's, kept by
services/kvstore/offload_tier.py.

Every call names the key space (model, layout version) of its chunks. Chunks travel as
columns, not as a list of maps: `hashes` holds the block hashes back to back (HASH_BYTES each,
raw bytes, never hex), `groups` each chunk's KV cache group, and where a call needs them `ends`
(tokens covered by the prefix a chunk ends) and `nbytes`, all packed. Column lengths must
agree and values must be in range, or the message does not decode (it is dead-lettered).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, Self

from pydantic import AfterValidator, Field, model_validator

from shared.kv.block_hash import HASH_BYTES
from shared.kv.offload_key import KeySpace, OffloadKey
from shared.protocol.base import Struct, register
from shared.protocol.packed import Blob, PackedInt32, PackedInt64, PackedUInt8
from shared.protocol.rpc import RpcReply, RpcRequest

MAX_CHUNKS = 65_536

#: Chunk statuses on the wire (KVLookupReply.statuses), by code.
CHUNK_STATES: tuple[str, ...] = ("missing", "writing", "ready", "pinned")
#: What the kvstore did with each offered chunk (KVStoreReply.outcomes), by code.
STORE_OUTCOMES: tuple[str, ...] = ("write", "present", "refused")


def _items(*, at_least: int | None = None, below: int | None = None) -> Any:
    """A packed column's checks: at most MAX_CHUNKS items, each in [at_least, below). (Field
    constraints do not reach packed fields: their validator replaces pydantic's own.)"""

    def check(values: list[int]) -> list[int]:
        if len(values) > MAX_CHUNKS:
            raise ValueError(f"{len(values)} items, more than {MAX_CHUNKS}")
        if at_least is not None and any(v < at_least for v in values):
            raise ValueError(f"every value must be >= {at_least}")
        if below is not None and any(v >= below for v in values):
            raise ValueError(f"every value must be < {below}")
        return values

    return AfterValidator(check)


class KVChunks(Struct):
    """Chunks named by (block hash, group)."""

    hashes: Blob
    groups: Annotated[PackedInt32, _items(at_least=0)]

    @model_validator(mode="after")
    def _columns_agree(self) -> Self:
        if len(self.hashes) % HASH_BYTES or len(self.hashes) > MAX_CHUNKS * HASH_BYTES:
            raise ValueError(
                f"hashes is {len(self.hashes)} bytes: {HASH_BYTES} per chunk, at most "
                f"{MAX_CHUNKS} chunks"
            )
        self._check_len("groups", len(self.groups))
        return self

    def _check_len(self, name: str, n: int) -> None:
        if n != len(self):
            raise ValueError(f"{name} has {n} items for {len(self)} chunks")

    def __len__(self) -> int:
        return len(self.hashes) // HASH_BYTES

    def offload_keys(self) -> list[OffloadKey]:
        h = self.hashes
        return [
            OffloadKey(h[i * HASH_BYTES : (i + 1) * HASH_BYTES], g)
            for i, g in enumerate(self.groups)
        ]

    @classmethod
    def of(cls, keys: Sequence[OffloadKey]) -> KVChunks:
        return cls(hashes=b"".join(k.block_hash for k in keys), groups=[k.group for k in keys])


class KVChunksAt(KVChunks):
    """Chunks with the end position of each (tokens covered by the prefix it ends)."""

    ends: Annotated[PackedInt32, _items(at_least=1)]

    @model_validator(mode="after")
    def _ends_agree(self) -> Self:
        self._check_len("ends", len(self.ends))
        return self

    @classmethod
    def at(cls, reads: Sequence[tuple[OffloadKey, int]]) -> KVChunksAt:
        return cls(
            hashes=b"".join(k.block_hash for k, _ in reads),
            groups=[k.group for k, _ in reads],
            ends=[end for _, end in reads],
        )


class KVChunkOffers(KVChunksAt):
    """Chunks with their end position and payload size."""

    nbytes: Annotated[PackedInt64, _items(at_least=0)]

    @model_validator(mode="after")
    def _sizes_agree(self) -> Self:
        self._check_len("nbytes", len(self.nbytes))
        return self

    @classmethod
    def offers(cls, offers: Sequence[tuple[OffloadKey, int, int]]) -> KVChunkOffers:
        return cls(
            hashes=b"".join(k.block_hash for k, _, _ in offers),
            groups=[k.group for k, _, _ in offers],
            ends=[end for _, end, _ in offers],
            nbytes=[n for _, _, n in offers],
        )


class KVScoped(RpcRequest):
    """A call about chunks of one model's key space."""

    model: str = Field(min_length=1, max_length=512)
    layout_version: int = Field(1, ge=0)

    def space(self, cluster: str) -> KeySpace:
        return KeySpace(cluster, self.model, self.layout_version)


# --- calls ------------------------------------------------------------------------------------


@register
class KVLookup(KVScoped):
    """Each chunk's status (not an access: recency changes only when a request finishes)."""

    TYPE = "kv_lookup"
    VERSION = 1

    chunks: KVChunks


@register
class KVStore(KVScoped):
    """Offer a request's chunks for store: absent ones are reserved (WRITING) if room is made."""

    TYPE = "kv_store"
    VERSION = 1

    request_id: str = Field(min_length=1, max_length=256)
    chunks: KVChunkOffers


@register
class KVWriting(KVScoped):
    """The step computing these chunks ended: their write deadline restarts now."""

    TYPE = "kv_writing"
    VERSION = 1

    chunks: KVChunks


@register
class KVStored(KVScoped):
    """Writes finished (`ok`) or failed; reports for chunks not being written are ignored."""

    TYPE = "kv_stored"
    VERSION = 1

    chunks: KVChunkOffers
    ok: bool = True


@register
class KVLoad(KVScoped):
    """Pin the ready chunks among `chunks` for `holder` (a request id, or a job id when
    `internal`: a tier-to-tier move pins but is not an access)."""

    TYPE = "kv_load"
    VERSION = 1

    holder: str = Field(min_length=1, max_length=256)
    internal: bool = False
    chunks: KVChunksAt


@register
class KVLoaded(KVScoped):
    """Release `holder`'s pins on `chunks` (the read finished)."""

    TYPE = "kv_loaded"
    VERSION = 1

    holder: str = Field(min_length=1, max_length=256)
    chunks: KVChunks


@register
class KVRequestFinished(RpcRequest):
    """Commit the request's one recency access; release any pin it still holds."""

    TYPE = "kv_request_finished"
    VERSION = 1

    request_id: str = Field(min_length=1, max_length=256)


@register
class KVStats(RpcRequest):
    TYPE = "kv_stats"
    VERSION = 1


# --- answers ----------------------------------------------------------------------------------


@register
class KVLookupReply(RpcReply):
    TYPE = "kv_lookup_reply"
    VERSION = 1

    statuses: Annotated[PackedUInt8, _items(below=len(CHUNK_STATES))]  # CHUNK_STATES codes


@register
class KVStoreReply(RpcReply):
    TYPE = "kv_store_reply"
    VERSION = 1

    outcomes: Annotated[PackedUInt8, _items(below=len(STORE_OUTCOMES))]  # STORE_OUTCOMES codes
    evicted: int = Field(0, ge=0)  # chunks evicted to make room


@register
class KVLoadReply(RpcReply):
    TYPE = "kv_load_reply"
    VERSION = 1

    pinned: Annotated[PackedUInt8, _items(below=2)]  # 1: pinned for the holder (read it now)


@register
class KVCountReply(RpcReply):
    """How many chunks a call changed: writes restarted, completed, or pins released."""

    TYPE = "kv_count_reply"
    VERSION = 1

    count: int = Field(ge=0)


@register
class KVFinishedReply(RpcReply):
    """The finished request's keys, by how it used them (zeros when it had none)."""

    TYPE = "kv_finished_reply"
    VERSION = 1

    keys: int = Field(0, ge=0)
    inserted: int = Field(0, ge=0)
    reused: int = Field(0, ge=0)
    store_misses: int = Field(0, ge=0)


@register
class KVStatsReply(RpcReply):
    TYPE = "kv_stats_reply"
    VERSION = 1

    chunks: int = Field(ge=0)
    used_bytes: int = Field(ge=0)
    capacity_bytes: int = Field(ge=0)
    writing: int = Field(ge=0)
    ready: int = Field(ge=0)
    pinned: int = Field(ge=0)
    evictions: int = Field(ge=0)
    requests: int = Field(ge=0)  # requests with a record (not finished yet)
    pin_holders: int = Field(ge=0)
    recovered: int = Field(ge=0)  # chunks rebuilt from metadata at start
    undeleted: int = Field(ge=0)  # evicted chunks whose Redis delete awaits a retry
