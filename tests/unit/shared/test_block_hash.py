"""Chained block hashes: stable across processes, full blocks only, chained, salted."""

from __future__ import annotations

import os
import subprocess
import sys

from shared.kv.block_hash import ROOT_HASH, extend_block_hashes, hash_block_tokens

TOKENS = list(range(100, 150))  # 3 full blocks of 16 and 2 tokens


def test_only_full_blocks_are_hashed_and_incremental_equals_batch() -> None:
    batch: list[bytes] = []
    extend_block_hashes(batch, TOKENS, 16)
    assert len(batch) == 3
    incremental: list[bytes] = []
    for n in range(1, len(TOKENS) + 1):
        extend_block_hashes(incremental, TOKENS[:n], 16)
        assert len(incremental) == n // 16
    assert incremental == batch


def test_hash_names_the_whole_prefix() -> None:
    a: list[bytes] = []
    b: list[bytes] = []
    extend_block_hashes(a, TOKENS, 16)
    other = TOKENS.copy()
    other[3] += 1  # differs in block 0 only
    extend_block_hashes(b, other, 16)
    assert all(x != y for x, y in zip(a, b, strict=True))  # every later block differs too
    same_block_other_parent = hash_block_tokens(a[0], TOKENS[16:32])
    assert same_block_other_parent == a[1]
    assert hash_block_tokens(b[0], TOKENS[16:32]) != a[1]


def test_cache_salt_separates_every_block() -> None:
    plain: list[bytes] = []
    salted: list[bytes] = []
    salted2: list[bytes] = []
    extend_block_hashes(plain, TOKENS, 16)
    extend_block_hashes(salted, TOKENS, 16, cache_salt="tenant-a")
    extend_block_hashes(salted2, TOKENS, 16, cache_salt="tenant-a")
    assert salted == salted2
    assert all(x != y for x, y in zip(plain, salted, strict=True))


def test_encoding_is_unambiguous() -> None:
    # Token bytes of a longer block must not collide with a shorter block plus extra keys.
    assert hash_block_tokens(ROOT_HASH, [1, 2]) != hash_block_tokens(
        ROOT_HASH, [1], (2).to_bytes(4, "little")
    )


def test_stable_across_processes_with_different_hash_seeds() -> None:
    code = (
        "from shared.kv.block_hash import extend_block_hashes as e\n"
        "h = []\n"
        f"e(h, {TOKENS!r}, 16, 'salt')\n"
        "print(','.join(x.hex() for x in h))\n"
    )
    here: list[bytes] = []
    extend_block_hashes(here, TOKENS, 16, "salt")
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        ).stdout.strip()
        assert out == ",".join(x.hex() for x in here)
