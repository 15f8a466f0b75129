"""Real offload keys for tests: chained block hashes of a token prefix, one key per chunk."""

from __future__ import annotations

from shared.kv.block_hash import extend_block_hashes
from shared.kv.offload_key import OffloadKey

CHUNK = 16


def prefix_chunks(num_chunks: int, group: int = 0, seed: int = 0) -> list[tuple[OffloadKey, int]]:
    """(key, end position) of each chunk of a `num_chunks`-chunk prompt, head first."""
    tokens = [seed * 100_000 + t for t in range(num_chunks * CHUNK)]
    hashes: list[bytes] = []
    extend_block_hashes(hashes, tokens, CHUNK)
    return [(OffloadKey(h, group), (i + 1) * CHUNK) for i, h in enumerate(hashes)]


def prefix_keys(num_chunks: int, group: int = 0, seed: int = 0) -> list[OffloadKey]:
    return [k for k, _ in prefix_chunks(num_chunks, group, seed)]
