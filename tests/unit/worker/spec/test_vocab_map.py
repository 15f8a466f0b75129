"""Draft vocabulary mapping: equal to the target's -> None; smaller -> the checkpoint's map;
smaller without one, larger, or a broken map -> a clear error."""

from __future__ import annotations

import pytest
import torch

from services.worker.spec.vocab_map import (
    DraftVocabError,
    draft_vocab_map,
    to_target_ids,
    to_target_logits,
)


def test_equal_vocabulary_gets_no_map_even_if_the_checkpoint_has_one() -> None:
    assert draft_vocab_map(10, 10, None) is None
    assert draft_vocab_map(10, 10, torch.zeros(10, dtype=torch.int64)) is None
    logits = torch.randn(2, 10)
    assert to_target_logits(logits, None, 10) is logits  # passed through, not copied
    ids = torch.tensor([3, 9])
    assert to_target_ids(ids, None) is ids


def test_smaller_vocabulary_gets_the_checkpoint_offsets() -> None:
    d2t = torch.tensor([0, 1, 3, 5])  # draft 0,1,2,3 -> target 0,2,5,8
    vocab_map = draft_vocab_map(10, 4, d2t)
    assert vocab_map is not None
    assert vocab_map.tolist() == [0, 2, 5, 8]
    assert to_target_ids(torch.tensor([2, 3, 0]), vocab_map).tolist() == [5, 8, 0]
    logits = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    spread = to_target_logits(logits, vocab_map, 10)
    assert spread.shape == (1, 10)
    assert spread[0, [0, 2, 5, 8]].tolist() == [1.0, 2.0, 3.0, 4.0]
    assert torch.isinf(spread[0, [1, 3, 4, 6, 7, 9]]).all()
    assert int(spread.argmax()) == 8  # the draft's argmax, as a target id


def test_smaller_vocabulary_without_a_map_is_an_error() -> None:
    with pytest.raises(DraftVocabError, match="no draft->target map"):
        draft_vocab_map(10, 4, None)


@pytest.mark.parametrize(
    ("draft_vocab", "d2t", "message"),
    [
        (12, None, "larger"),
        (4, torch.tensor([0, 1, 2]), "shape"),
        (4, torch.tensor([0, 1, 2, 7]), "outside"),
        (4, torch.tensor([0, 0, -1, 0]), "same target id"),
    ],
)
def test_bad_maps_are_refused(draft_vocab: int, d2t: torch.Tensor | None, message: str) -> None:
    with pytest.raises(DraftVocabError, match=message):
        draft_vocab_map(10, draft_vocab, d2t)
