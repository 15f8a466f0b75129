"""Logits transforms, one at a time, on hand-checkable numbers."""

from __future__ import annotations

import torch

from services.worker.sampling.row_tokens import BatchEntries
from services.worker.sampling.transforms import (
    add_entries,
    apply_penalties,
    keep_only_entries,
    mask_entries,
    truncation_mask,
)

INF = float("inf")


def _entries(rows: list[int], tokens: list[int], values: list[float] | None = None):
    return BatchEntries(
        torch.tensor(rows, dtype=torch.int64),
        torch.tensor(tokens, dtype=torch.int64),
        torch.tensor(values or [0.0] * len(rows), dtype=torch.float32),
    )


def test_penalties_follow_the_openai_and_vllm_definitions() -> None:
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0, 1.0, 1.0]])
    prompt = torch.tensor([[True, True, False, False, False, False]])
    counts = torch.tensor([[0, 0, 0, 0, 3, 0]], dtype=torch.int32)
    out = apply_penalties(
        logits, prompt, counts, torch.tensor([2.0]), torch.tensor([0.5]), torch.tensor([0.25])
    )
    # Repetition: seen positive logits divided, seen negative multiplied; unseen untouched.
    # Token 4 was output 3 times: /2, then -0.5*3 frequency, -0.25 presence.
    expected = torch.tensor([[1.0, -4.0, 2.0, -2.0, 0.5 - 1.5 - 0.25, 1.0]])
    assert torch.equal(out, expected)


def test_neutral_penalties_leave_logits_bit_identical() -> None:
    logits = torch.randn(2, 50)
    logits[0, 3] = -INF
    prompt = torch.rand(2, 50) < 0.5
    counts = torch.randint(0, 3, (2, 50), dtype=torch.int32)
    out = apply_penalties(logits, prompt, counts, torch.ones(2), torch.zeros(2), torch.zeros(2))
    assert torch.equal(out, logits)


def test_masks_and_bias_entries() -> None:
    """Two batch rows and the scratch row (2): entries pointed there touch no batch row."""
    staged = torch.zeros(3, 5)
    logits = staged[:2]
    mask_entries(staged, _entries([0, 1, 2], [1, 4, 0]))
    add_entries(staged, _entries([0, 0, 2], [2, 3, 2], [1.5, -2.0, 7.0]))
    assert logits.tolist() == [[0, -INF, 1.5, -2.0, 0], [0, 0, 0, 0, -INF]]
    keep_only_entries(staged, torch.tensor([False, True]), _entries([1, 1, 2], [0, 4, 1]))
    assert logits.tolist() == [[0, -INF, 1.5, -2.0, 0], [0, -INF, -INF, -INF, -INF]]


def test_top_k_keeps_ties_and_is_per_row() -> None:
    scaled = torch.tensor([[5.0, 4.0, 4.0, 1.0, 0.0], [5.0, 4.0, 3.0, 2.0, 1.0]])
    removed = truncation_mask(scaled, None, torch.tensor([2, 5]), None)
    assert removed.tolist() == [[False, False, False, True, True], [False] * 5]
    removed = truncation_mask(scaled, None, torch.tensor([1, 3]), None, max_top_k=3)
    assert removed.tolist() == [[False, True, True, True, True], [False] * 3 + [True] * 2]


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.25, 0.25, 0.25, 0.25]])
    scaled = probs.log()
    removed = truncation_mask(scaled, None, None, torch.tensor([0.8, 0.3]))
    # Row 0: 0.5 < 0.8 so keep the 0.3 token (mass 0.8 reached), drop the rest.
    assert removed[0].tolist() == [False, False, True, True]
    assert int((~removed[1]).sum()) == 2  # 0.25 < 0.3: a second token is needed
    removed = truncation_mask(scaled, None, None, torch.tensor([0.01, 1.0]))
    assert removed.tolist() == [[False, True, True, True], [False] * 4]


def test_min_p_is_relative_to_the_top_probability() -> None:
    probs = torch.tensor([[0.6, 0.3, 0.07, 0.03]])
    removed = truncation_mask(probs.log(), torch.tensor([0.1]), None, None)
    assert removed.tolist() == [[False, False, False, True]]  # threshold 0.06
    removed = truncation_mask(probs.log(), torch.tensor([0.2]), None, None)
    assert removed.tolist() == [[False, False, True, True]]  # threshold 0.12
    assert not bool(truncation_mask(probs.log(), torch.tensor([0.0]), None, None).any())


def test_truncations_compose_in_vllm_order() -> None:
    probs = torch.tensor([[0.4, 0.3, 0.2, 0.06, 0.04]])
    # min_p 0.2 -> threshold 0.08 drops 0.06/0.04; top_k 2 keeps 0.4, 0.3; top_p 0.5 of the
    # survivors' renormalized mass (0.4/0.7 = 0.57 >= 0.5) keeps only the first.
    removed = truncation_mask(
        probs.log(), torch.tensor([0.2]), torch.tensor([2]), torch.tensor([0.5])
    )
    assert removed.tolist() == [[False, True, True, True, True]]
    removed = truncation_mask(probs.log(), torch.tensor([0.2]), torch.tensor([2]), None)
    assert removed.tolist() == [[False, False, True, True, True]]
