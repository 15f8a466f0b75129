"""Grammar bitmask layout: bit j of word w allows token 32w + j."""

from __future__ import annotations

import torch

from meshllm_kernels.sampling.bitmask import allowed_mask, pack_bitmask, unpack_bitmask


def test_bit_layout_matches_xgrammar() -> None:
    words = torch.tensor([[1 << 5, -(2**31), 0, 3]], dtype=torch.int32)
    allowed = unpack_bitmask(words, 128)
    assert allowed[0].nonzero().squeeze(1).tolist() == [5, 63, 96, 97]


def test_pack_unpack_round_trip_with_a_ragged_last_word() -> None:
    gen = torch.Generator().manual_seed(0)
    allowed = torch.rand(3, 100, generator=gen) < 0.5
    packed = pack_bitmask(allowed)
    assert packed.dtype == torch.int32 and packed.shape == (3, 4)
    assert torch.equal(unpack_bitmask(packed, 100), allowed)


def test_tokens_past_the_bitmask_are_disallowed_and_extra_words_ignored() -> None:
    packed = torch.full((1, 2), -1, dtype=torch.int32)  # covers tokens 0..63
    allowed = unpack_bitmask(packed, 100)
    assert bool(allowed[0, :64].all()) and not bool(allowed[0, 64:].any())
    assert unpack_bitmask(packed, 40).shape == (1, 40)


def test_index_minus_one_is_unconstrained() -> None:
    packed = pack_bitmask(torch.tensor([[False, True, False]]))
    mask = allowed_mask(packed, torch.tensor([-1, 0, -1]), 3)
    assert mask.tolist() == [[True] * 3, [False, True, False], [True] * 3]
