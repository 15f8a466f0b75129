"""Structured-output token bitmasks (xgrammar's layout) as boolean masks.

A bitmask row is packed int32 words: bit j of word w set means token 32·w + j is allowed.
Rows come only for constrained requests, so a batch row points at a bitmask row through
`bitmask_index` (-1: unconstrained, every token allowed). A constrained row allows no token at
or past 32·W: the grammar's vocabulary ends there (xgrammar never allows padding ids); words
past the logits' vocabulary are ignored.
"""

from __future__ import annotations

import numpy as np
import torch

BITS = torch.arange(32, dtype=torch.int32)


def bitmask_words(vocab_size: int) -> int:
    """Words per bitmask row that cover a vocabulary: ceil(V / 32)."""
    return (vocab_size + 31) // 32


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool [G, vocab_size] from packed int32 [G, W]."""
    if bitmask.device.type == "cpu":
        return _unpack_on_cpu(bitmask, vocab_size)
    bits = BITS.to(bitmask.device)
    unpacked = ((bitmask.to(torch.int32).unsqueeze(-1) >> bits) & 1).bool()
    unpacked = unpacked.reshape(bitmask.shape[0], -1)[:, :vocab_size]
    if unpacked.shape[1] < vocab_size:
        pad = unpacked.new_zeros(bitmask.shape[0], vocab_size - unpacked.shape[1])
        unpacked = torch.cat([unpacked, pad], dim=1)
    return unpacked


def _unpack_on_cpu(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """numpy's unpackbits: one single-threaded pass (the torch shift-and-mask above costs many
    times more, and far more with intra-op threads on a busy CPU). Little-endian words as bytes,
    bits least significant first, are tokens in order."""
    words = bitmask.detach().to(torch.int32).numpy().astype("<i4", copy=False)
    bits = np.unpackbits(words.view(np.uint8), axis=-1, bitorder="little").view(np.bool_)
    if bits.shape[1] < vocab_size:
        bits = np.pad(bits, ((0, 0), (0, vocab_size - bits.shape[1])))
    return torch.from_numpy(np.ascontiguousarray(bits[:, :vocab_size]))


def allowed_mask(
    bitmask: torch.Tensor, bitmask_index: torch.Tensor, vocab_size: int
) -> torch.Tensor:
    """bool [B, vocab_size]: row i allows what bitmask row bitmask_index[i] allows (-1: all)."""
    index = bitmask_index.to(torch.int64)
    constrained = index >= 0
    mask = torch.ones(index.shape[0], vocab_size, dtype=torch.bool, device=bitmask.device)
    if bool(constrained.any()):
        mask[constrained] = unpack_bitmask(bitmask[index[constrained]], vocab_size)
    return mask


def pack_bitmask(allowed: torch.Tensor) -> torch.Tensor:
    """int32 [G, ceil(V/32)] from bool [G, V]; the inverse of unpack_bitmask (for tests, tools)."""
    rows, vocab = allowed.shape
    padded = allowed.new_zeros(rows, bitmask_words(vocab) * 32)
    padded[:, :vocab] = allowed
    words = padded.reshape(rows, -1, 32).to(torch.int64) << BITS.to(torch.int64).to(allowed.device)
    packed = words.sum(dim=-1)  # < 2^32, exact in int64
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
