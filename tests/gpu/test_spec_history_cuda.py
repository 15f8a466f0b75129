"""Speculative decoding of penalized and min_tokens requests on the GPU (tests/unit/worker/
test_spec_history.py's checks with device="cuda"), and a verify step's provisional records
(SamplingState.provisional) never waiting for the device."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.worker.sampling import SamplingState
from shared.protocol import SamplingParams
from tests.support.host_sync import guarded
from tests.support.tiny_llama import make_tiny_llama
from tests.unit.worker.test_spec_history import (
    CASES,
    check_equal_with_oracle_drafts,
    check_min_tokens,
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-spec-history-cuda")
    make_tiny_llama(path, vocab_size=64)
    return path


@pytest.mark.parametrize("case", list(CASES))
def test_penalized_requests_speculate_and_equal_plain_decoding_on_cuda(
    tiny: Path, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    check_equal_with_oracle_drafts(tiny, monkeypatch, CASES[case], "cuda")


def test_min_tokens_counts_the_drafts_on_cuda(tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    check_min_tokens(tiny, monkeypatch, "cuda")


def test_provisional_records_never_synchronize() -> None:
    V = 1024
    state = SamplingState(4, V, "cuda", eos_token_ids=[2])
    penalized = SamplingParams(presence_penalty=0.5, min_tokens=3, bad_words_token_ids=[[5, 6]])
    state.add_request(1, penalized, [4, 5], [6])
    logits = torch.randn(2, V, device="cuda")
    rows = torch.tensor([1, 1], device="cuda")
    positions = torch.tensor([3, 4], device="cuda")
    drafts = torch.tensor([7, 5], device="cuda")
    state.sample(logits, rows, positions)  # first use: tables allocated
    torch.cuda.synchronize()

    def step(_: object) -> None:
        history = state.provisional()
        for j in range(2):
            state.sample(logits[j : j + 1], rows[j : j + 1], positions[j : j + 1])
            history.record(rows[j : j + 1], drafts[j : j + 1])
        history.undo()

    sites: list[str] = []
    guarded(step, sites)(None)
    assert not sites, f"synchronized at: {sorted(set(sites))}"
