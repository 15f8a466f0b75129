"""SamplingState.provisional: a verify step records each position's drafts as outputs before
drawing the next position, then takes them all back. Recording must change what the next draw
sees exactly as record_sampled would, and undo must leave every recorded table as it was."""

from __future__ import annotations

import torch

from services.worker.sampling import SamplingState
from shared.protocol import SamplingParams

V = 32
EOS = 2


def tables(state: SamplingState) -> list[torch.Tensor]:
    """Everything record_sampled writes."""
    assert state.output_counts is not None
    return [
        state.num_output.clone(),
        state.output_counts.clone(),
        state.bad_words.saved_window(),
    ]


def loaded_state() -> SamplingState:
    state = SamplingState(3, V, eos_token_ids=[EOS])
    penalized = SamplingParams(
        temperature=0, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.2
    )
    state.add_request(0, penalized, [4, 5], [6, 6, 7])
    state.add_request(1, SamplingParams(bad_words_token_ids=[[8, 9, 10]], min_tokens=4), [4], [8])
    state.add_request(2, SamplingParams(), [4], [])
    return state


def test_records_are_seen_and_undone() -> None:
    """Row 0 (greedy, penalized) prefers token 11 by a little until 11 is recorded; row 1
    (sampled) may not end its word 8 9 10 once 8 9 are its latest outputs, and may stop once
    its outputs reach min_tokens."""
    state = loaded_state()
    before = tables(state)
    logits = torch.zeros(3, V)
    logits[0, 11] = 0.3
    rows, positions = torch.tensor([0, 1, 2]), torch.tensor([5, 2, 1])

    def draw() -> tuple[int, torch.Tensor]:
        out = state.sample(logits.clone(), rows, positions, return_probs=True)
        assert out.probs is not None
        return int(out.token_ids[0]), out.probs[1]

    token, probs = draw()
    assert token == 11 and float(probs[10]) > 0 and float(probs[EOS]) == 0

    history = state.provisional()
    history.record(torch.tensor([0, 1, 1]), torch.tensor([11, 9, 9]))
    history.record(torch.tensor([1, 1]), torch.tensor([8, 9]))  # row 1 ends in 8 9
    assert state.num_output.tolist() == [4, 5, 0]
    token, probs = draw()
    assert token != 11  # penalized now
    assert float(probs[10]) == 0  # the word's last token, after its prefix
    assert float(probs[EOS]) > 0  # 5 outputs: min_tokens 4 reached

    history.undo()
    for was, now in zip(before, tables(state), strict=True):
        assert torch.equal(was, now)
    token, probs = draw()
    assert token == 11 and float(probs[10]) > 0 and float(probs[EOS]) == 0


def test_undo_then_record_equals_recording_the_accepted_tokens_alone() -> None:
    plain, spec = loaded_state(), loaded_state()
    accepted = (torch.tensor([0, 1]), torch.tensor([6, 9]))
    plain.record_sampled(*accepted)
    history = spec.provisional()
    history.record(torch.tensor([0, 1]), torch.tensor([6, 9]))
    history.record(torch.tensor([0, 1]), torch.tensor([13, 3]))  # drafts later rejected
    history.undo()
    spec.record_sampled(*accepted)
    for a, b in zip(tables(plain), tables(spec), strict=True):
        assert torch.equal(a, b)


def test_nothing_recorded_where_no_sampling_reads_outputs() -> None:
    state = SamplingState(2, V)
    state.add_request(0, SamplingParams(temperature=0.7, seed=3), [4], [])
    history = state.provisional()
    history.record(torch.tensor([0]), torch.tensor([5]))
    assert not state.counts_outputs and state.num_output.tolist() == [0, 0]
    history.undo()
