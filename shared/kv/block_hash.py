"""Chained block hashes: one hash names a whole token prefix up to a block boundary.

hash(block i) = H(hash(block i-1), token ids of block i, extra keys of block i), for FULL blocks
only: a partial block's content is still changing, so it has no name yet.

The hash must be stable across processes and machines, because the KV offload tier stores
blocks under it and other workers/schedulers look them up later. Python's `hash()` is salted
per process, so we use sha256 over an unambiguous byte encoding (every variable-length part is
length-prefixed, tokens are little-endian int32) truncated to 16 bytes; a collision would
silently serve another prefix's KV, and 128 bits keeps that out of reach.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

BlockHash = bytes
"""16 bytes; equal hashes mean equal prefixes (same tokens, same extra keys, from the start)."""

HASH_BYTES = 16

#: Parent of the first block. A fixed domain string (not random) keeps hashes stable across
#: processes; bump the version if the encoding below ever changes.
ROOT_HASH: BlockHash = hashlib.sha256(b"meshllm.kv-block-hash.v1").digest()[:HASH_BYTES]


def hash_block_tokens(
    parent: BlockHash, token_ids: Sequence[int], extra_keys: bytes = b""
) -> BlockHash:
    """The hash of one full block, chained to its parent's hash."""
    n = len(token_ids)
    h = hashlib.sha256(parent)
    h.update(struct.pack(f"<I{n}i", n, *token_ids))
    h.update(struct.pack("<I", len(extra_keys)))
    h.update(extra_keys)
    return h.digest()[:HASH_BYTES]


def block_extra_keys(block_index: int, cache_salt: str | None) -> bytes:
    """Extra keys of one block. The cache salt goes into the first block only: chaining carries
    it into every later hash, so two tenants with different salts never share any block."""
    if block_index == 0 and cache_salt:
        return b"salt:" + cache_salt.encode()
    return b""


def extend_block_hashes(
    hashes: list[BlockHash],
    token_ids: Sequence[int],
    block_size: int,
    cache_salt: str | None = None,
) -> None:
    """Append the hashes of blocks that became full since `hashes` was last extended.

    Incremental by construction: each call costs only the newly full blocks, so appending one
    decode token is O(1) amortized.
    """
    start = len(hashes)
    num_full = len(token_ids) // block_size
    parent = hashes[-1] if hashes else ROOT_HASH
    for i in range(start, num_full):
        begin = i * block_size
        parent = hash_block_tokens(
            parent, token_ids[begin : begin + block_size], block_extra_keys(i, cache_salt)
        )
        hashes.append(parent)
