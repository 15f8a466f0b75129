"""bad_words on the GPU (services/worker/sampling/bad_words.py): the masks equal the
reference's over random batches, and joining, sampling, recording and leaving never wait for
the device (the worker launches step N + 1 before step N's tokens reach the host)."""

from __future__ import annotations

import torch

from services.worker.sampling import SamplingState
from shared.protocol import SamplingParams
from tests.support.host_sync import guarded
from tests.unit.worker.sampling.test_bad_words import check_random_batches

V = 1024


def test_random_batches_follow_the_reference_on_cuda() -> None:
    check_random_batches("cuda")


def test_the_bad_words_stage_never_synchronizes() -> None:
    state = SamplingState(8, V, "cuda")
    words = [[5], [7, 8], [1, 2, 3, 4]]
    logits = torch.randn(3, V, device="cuda")
    rows = torch.tensor([2, 0, 5], device="cuda")
    positions = torch.tensor([4, 4, 4], device="cuda")
    recorded_rows = torch.tensor([2, 5, 2, 0, 2], device="cuda")  # a verify step's, say
    recorded = torch.tensor([1, 7, 2, -1, 3], device="cuda")
    torch.cuda.synchronize()

    def steps(_: object) -> None:
        state.add_request(2, SamplingParams(temperature=0.7, bad_words_token_ids=words), [1], [1])
        state.add_request(0, SamplingParams(temperature=0.0), [1], [])
        state.add_request(5, SamplingParams(bad_words_token_ids=[[9, 9]]), [1], [6, 9])
        for _ in range(3):
            out = state.sample(logits, rows, positions)
            state.record_sampled(rows, out.token_ids)
            state.record_sampled(recorded_rows, recorded)
        state.remove_request(2)  # the window shrinks to one token: still no sync
        state.sample(logits, rows, positions)

    sites: list[str] = []
    guarded(steps, sites)(None)
    assert not sites, f"synchronized at: {sorted(set(sites))}"
