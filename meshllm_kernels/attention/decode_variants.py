"""The decode-attention kernel specializations a server can meet, compiled before it serves.

A launch of paged_decode_attention compiles once per specialization: its LaunchChoice (split
count, strided kernel or not, tiles: all constexprs) and what Triton specializes on its integer
arguments, among them the block table's width (the table's row stride, and the strided kernel's
column count), by whether it is 1 or a multiple of 16. CUDA graphs fix their choice at capture;
eager steps (prefill chunks with decodes beside them) choose it from the step's decode rows
and their longest context, so over a server's life they meet any choice `decode_variants`
lists. On the H200 the first eager step with 128 decodes beside a prefill waited 1.5 s for one
such compile. `compile_decode_variants` launches each choice once, at every table width class
the serving path uses, on one sequence of one key, so that no serving step waits for it.
"""

from __future__ import annotations

import math
import time

import torch
import triton

from meshllm_kernels.attention.paged_decode import (
    DECODE_TILES,
    MANY_PROGRAMS,
    MIN_KEYS_PER_SPLIT,
    SHORT_KEYS_PER_SPLIT,
    LaunchChoice,
    default_num_splits,
    launch_choice,
    paged_decode_attention,
)

# Every length threshold of default_num_splits is a multiple of this many keys, so the split
# count is constant between two of its multiples: evaluating the spans at its multiples sees
# every value.
KEY_STEP = math.gcd(MIN_KEYS_PER_SPLIT, SHORT_KEYS_PER_SPLIT, DECODE_TILES.block_n)


def seq_counts(num_kv_heads: int, num_sms: int, max_num_seqs: int) -> list[int]:
    """Sequence counts at which the choice can differ: each one while the (sequence, kv head)
    programs number fewer than two waves (the split count depends on them), then only the
    single-pass tiles change, at MANY_PROGRAMS programs."""
    two_waves = triton.cdiv(2 * num_sms, num_kv_heads)
    counts = set(range(1, min(max_num_seqs, two_waves) + 1))
    counts |= {min(max_num_seqs, triton.cdiv(MANY_PROGRAMS, num_kv_heads)), max_num_seqs}
    return sorted(c for c in counts if c >= 1)


def decode_variants(
    num_kv_heads: int,
    head_dim: int,
    cache_element_size: int,
    num_sms: int,
    max_num_seqs: int,
    max_seq_len: int,
    window: int = 0,
) -> set[LaunchChoice]:
    """Every LaunchChoice paged_decode_attention makes by itself (split count from
    default_num_splits) for 1..max_num_seqs sequences of contexts up to max_seq_len keys."""
    longest = min(max_seq_len, window) if window else max_seq_len
    spans = range(KEY_STEP, triton.cdiv(max(1, longest), KEY_STEP) * KEY_STEP + 1, KEY_STEP)
    found: set[LaunchChoice] = set()
    for seqs in seq_counts(num_kv_heads, num_sms, max_num_seqs):
        for splits in {default_num_splits(seqs, num_kv_heads, span, num_sms) for span in spans}:
            found.add(
                launch_choice(
                    seqs, num_kv_heads, splits, window, head_dim, cache_element_size, num_sms
                )
            )
    return found


def compile_decode_variants(
    kv_cache: torch.Tensor,
    num_heads: int,
    dtype: torch.dtype,
    variants: set[LaunchChoice],
    table_widths: set[int],
    window: int = 0,
) -> float:
    """Launch every choice at every table width on one sequence of one key (reads block 0 of
    `kv_cache`, writes nothing into it); returns the seconds taken. `dtype` is the queries'
    (the model's) dtype, part of the specialization too."""
    started = time.perf_counter()
    head_dim = kv_cache.shape[-1]
    device = kv_cache.device
    q = torch.zeros(1, num_heads, head_dim, dtype=dtype, device=device)
    lens = torch.ones(1, dtype=torch.int32, device=device)
    for width in sorted(table_widths):
        tables = torch.zeros(1, width, dtype=torch.int32, device=device)
        for choice in sorted(variants, key=lambda c: (c.strided, c.num_splits, c.tiles.block_n)):
            paged_decode_attention(
                q, kv_cache, tables, lens, sliding_window=window or None,
                num_splits=choice.num_splits, max_seq_len=1, tiles=choice.tiles,
                strided=choice.strided,
            )  # fmt: skip
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - started
