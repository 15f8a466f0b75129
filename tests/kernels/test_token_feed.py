"""The decode graph's token feed (meshllm_kernels/decode_chain/token_feed.py): ids -(row + 1) become
latest[row]."""

from __future__ import annotations

import pytest
import torch

from meshllm_kernels.decode_chain.token_feed import feed_token_ids_, feed_token_ids_reference
from services.worker.runner.in_flight import fed_id


def test_fed_ids_take_the_rows_latest_token_and_others_stay(device: torch.device) -> None:
    latest = torch.tensor([11, 22, 33, 44, 55], dtype=torch.int64, device=device)
    ids = torch.tensor([7, fed_id(3), 0, fed_id(0), fed_id(4), 128255], device=device)
    expected = feed_token_ids_reference(ids, latest)
    out = feed_token_ids_(ids, latest)
    assert out is ids  # in place: the graph's static input
    assert ids.tolist() == [7, 44, 0, 11, 55, 128255]
    assert torch.equal(ids, expected)


def test_more_ids_than_one_program_holds(device: torch.device) -> None:
    gen = torch.Generator().manual_seed(3)
    latest = torch.randint(0, 50_000, (300,), generator=gen)
    ids = torch.randint(0, 50_000, (700,), generator=gen)
    fed = torch.rand(700, generator=gen) < 0.5
    rows = torch.randint(0, 300, (700,), generator=gen)
    ids = torch.where(fed, -rows - 1, ids).to(device)
    expected = torch.where(fed, latest[rows], ids.cpu())
    feed_token_ids_(ids, latest.to(device))
    assert torch.equal(ids.cpu(), expected)


def test_bad_inputs_are_named(device: torch.device) -> None:
    latest = torch.zeros(4, dtype=torch.int64, device=device)
    with pytest.raises(TypeError, match="ids"):
        feed_token_ids_(torch.zeros(3, dtype=torch.int32, device=device), latest)
    with pytest.raises(ValueError, match="ids"):
        feed_token_ids_(torch.zeros(2, 3, dtype=torch.int64, device=device), latest)
    with pytest.raises(TypeError, match="latest"):
        feed_token_ids_(torch.zeros(3, dtype=torch.int64, device=device), latest.float())
