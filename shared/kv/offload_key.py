"""Offload keys and the Redis key names they live under.

An offload key is (block hash, group): the block hash names a whole token prefix (see
`shared.kv.block_hash`), and each KV cache group holds a different tensor for the same
prefix, so the group is part of the identity. One key names one offload chunk (one or more
blocks, ending at the block the hash names).

In Redis a chunk is two keys:
- the payload `meshllm:<cluster>:kv:<model>:<layout_version>:<group>:<hash hex>`, written and
  read by workers;
- its metadata `meshllm:<cluster>:kvmeta:<model>:<layout_version>:<group>:<hash hex>`, written
  by the kvstore once the payload is complete (size, end position, store sequence).
The model name and the layout version are in the name because a payload is only meaningful to
the model and tensor layout that wrote it: two models (or one model after a layout change)
never read each other's bytes, even for equal token prefixes. The ACL grants on
`meshllm:*:kv:*` and `meshllm:*:kvmeta:*` match these names.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import quote

from shared.kv.block_hash import HASH_BYTES, BlockHash

#: The payload layout version (header + tensor layout of one chunk) that key names carry. The
#: worker's payload module (services.worker.kv_offload.payload) must write this version: a test
#: keeps the two equal, so a layout change bumps the names and old payloads are never read.
LAYOUT_VERSION = 1


@dataclass(frozen=True, slots=True, order=True)
class OffloadKey:
    """One offload chunk of one KV cache group, named by the hash of its last block."""

    block_hash: BlockHash
    group: int

    def __post_init__(self) -> None:
        if not isinstance(self.block_hash, bytes) or len(self.block_hash) != HASH_BYTES:
            raise ValueError(f"block_hash must be {HASH_BYTES} bytes, got {self.block_hash!r}")
        if self.group < 0:
            raise ValueError(f"group must be >= 0, got {self.group}")

    @classmethod
    def from_hex(cls, block_hash_hex: str, group: int) -> OffloadKey:
        try:
            raw = bytes.fromhex(block_hash_hex)
        except ValueError:
            raise ValueError(f"block hash is not hex: {block_hash_hex!r}") from None
        return cls(raw, group)

    def __repr__(self) -> str:
        return f"OffloadKey({self.block_hash.hex()[:8]}.., g{self.group})"


@dataclass(frozen=True, slots=True)
class KeySpace:
    """Where one model's offloaded KV lives in one cluster's Redis."""

    cluster: str
    model: str
    layout_version: int = LAYOUT_VERSION

    def __post_init__(self) -> None:
        if not self.cluster or ":" in self.cluster:
            raise ValueError(f"cluster must be non-empty and contain no ':', got {self.cluster!r}")
        if not self.model:
            raise ValueError("model must be non-empty")
        if self.layout_version < 0:
            raise ValueError(f"layout_version must be >= 0, got {self.layout_version}")

    @property
    def _scope(self) -> str:
        # Quoting keeps the ':'-separated fields parseable whatever the served model name is
        # ("llama3:8b", "org/model"); it is deterministic, so every service derives equal names.
        return f"{quote(self.model, safe='')}:{self.layout_version}"

    @property
    def payload_prefix(self) -> str:
        return f"meshllm:{self.cluster}:kv:{self._scope}:"

    @property
    def meta_prefix(self) -> str:
        return f"meshllm:{self.cluster}:kvmeta:{self._scope}:"

    def payload_key(self, key: OffloadKey) -> str:
        return f"{self.payload_prefix}{key.group}:{key.block_hash.hex()}"

    def meta_key(self, key: OffloadKey) -> str:
        return f"{self.meta_prefix}{key.group}:{key.block_hash.hex()}"

    def parse(self, name: str) -> OffloadKey:
        """The offload key of a payload or metadata key name of this space."""
        for prefix in (self.payload_prefix, self.meta_prefix):
            if name.startswith(prefix):
                group, _, hex_hash = name[len(prefix) :].partition(":")
                if group.isdigit():
                    return OffloadKey.from_hex(hex_hash, int(group))
        raise ValueError(f"{name!r} is not an offload key of {self.payload_prefix}*")


def meta_prefix(cluster: str) -> str:
    """Prefix of every offload metadata key of a cluster, whatever the model."""
    return f"meshllm:{cluster}:kvmeta:"


def meta_key_of_payload(payload_key: str) -> str:
    """The metadata key that goes with a payload key (same suffix, `kv` -> `kvmeta`)."""
    head, sep, rest = payload_key.partition(":kv:")
    if not sep or not head.startswith("meshllm:"):
        raise ValueError(f"{payload_key!r} is not an offload payload key")
    return f"{head}:kvmeta:{rest}"


def payload_key_of_meta(meta_key: str) -> str:
    """Inverse of `meta_key_of_payload`."""
    head, sep, rest = meta_key.partition(":kvmeta:")
    if not sep or not head.startswith("meshllm:"):
        raise ValueError(f"{meta_key!r} is not an offload metadata key")
    return f"{head}:kv:{rest}"
