"""bad_words (vLLM v1's rule): a word's last token is banned while its other tokens are the
latest outputs, checked against a plain-Python reference of that rule over random batches,
steps recorded on the device, preemption and rows that leave."""

from __future__ import annotations

import random

import pytest
import torch

from services.worker.sampling import SamplingState
from shared.protocol import SamplingParams

V = 64
HOT = range(4)  # the few tokens words are made of and draws favour, so words do match


def reference_banned(words: list[list[int]], outputs: list[int]) -> set[int]:
    """vLLM v1 (vllm/v1/sample/ops/bad_words.py), per word: the last token is banned when the
    outputs end with the other tokens (a one-token word: always)."""
    banned: set[int] = set()
    for word in words:
        prefix = word[:-1]
        if len(prefix) > len(outputs):
            continue
        if not prefix or outputs[-len(prefix) :] == prefix:
            banned.add(word[-1])
    return banned


def masked(
    state: SamplingState, logits: torch.Tensor, rows: list[int], positions: list[int]
) -> tuple[list[set[int]], torch.Tensor]:
    """Each batch row's tokens at -inf after the processing (zero probability; the logits here
    are small, so nothing else underflows), and the drawn tokens."""
    out = state.sample(logits, torch.tensor(rows), torch.tensor(positions), return_probs=True)
    assert out.probs is not None
    zeros = [set(torch.nonzero(row == 0).flatten().tolist()) for row in out.probs]
    return zeros, out.token_ids


def hot_logits(rng: torch.Generator, batch: int) -> torch.Tensor:
    logits = torch.randn(batch, V, generator=rng)
    logits[:, list(HOT)] += 4.0
    return logits


def random_words(rnd: random.Random) -> list[list[int]]:
    return [
        [rnd.choice(HOT) for _ in range(rnd.choice((1, 2, 2, 3, 4)))]
        for _ in range(rnd.randint(1, 4))
    ]


def test_random_batches_follow_the_reference_step_after_step() -> None:
    check_random_batches("cpu")


def check_random_batches(device: str) -> None:
    """Rows join (some resumed with outputs), leave and sample in random batches; every step's
    masked tokens are the reference's. tests/gpu/test_bad_words_cuda.py runs it on CUDA."""
    rnd = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    rows_total = 8
    state = SamplingState(rows_total, V, device)
    words: dict[int, list[list[int]]] = {}
    outputs: dict[int, list[int]] = {}

    def join(row: int) -> None:
        resumed = [rnd.choice(HOT) for _ in range(rnd.choice((0, 0, 1, 3, 6)))]
        row_words = random_words(rnd) if rnd.random() < 0.7 else []
        temperature = rnd.choice((0.0, 0.8))
        params = SamplingParams(temperature=temperature, seed=row, bad_words_token_ids=row_words)
        state.add_request(row, params, [rnd.choice(HOT) for _ in range(3)], resumed)
        words[row], outputs[row] = row_words, resumed

    for row in range(6):
        join(row)
    matched = 0
    for step in range(80):
        if rnd.random() < 0.2:  # churn: a row leaves, another (maybe resumed) joins
            row = rnd.randrange(rows_total)
            if row in words and rnd.random() < 0.5:
                state.remove_request(row)
                del words[row], outputs[row]
            else:
                join(row)
        batch = rnd.sample(sorted(words), k=rnd.randint(1, len(words)))
        positions = [len(outputs[r]) + 10 for r in batch]
        logits = hot_logits(gen, len(batch)).to(device)
        zeros, drawn = masked(state, logits, batch, positions)
        for i, row in enumerate(batch):
            expected = reference_banned(words[row], outputs[row])
            assert zeros[i] == expected, (step, row, words[row], outputs[row])
            assert int(drawn[i]) not in expected
            matched += sum(
                len(w) > 1 and bool(reference_banned([w], outputs[row])) for w in words[row]
            )
        # Record as the verify path does now and then: several tokens a row in one call, with
        # placeholders (-1) that count for nothing; rows interleaved, each row's tokens in order.
        pending: dict[int, list[int]] = {}
        for i, row in enumerate(batch):
            pending[row] = [int(drawn[i])]
            if rnd.random() < 0.3:
                pending[row] += [rnd.choice([*HOT, -1]) for _ in range(rnd.randint(1, 5))]
            outputs[row] += [t for t in pending[row] if t >= 0]
        rec_rows: list[int] = []
        rec_tokens: list[int] = []
        while pending:
            row = rnd.choice(sorted(pending))
            rec_rows.append(row)
            rec_tokens.append(pending[row].pop(0))
            if not pending[row]:
                del pending[row]
        state.record_sampled(torch.tensor(rec_rows), torch.tensor(rec_tokens))
    assert matched > 15  # the prefixes really were matched, not only single tokens banned


def test_one_token_words_are_banned_from_the_start() -> None:
    state = SamplingState(2, V)
    state.add_request(1, SamplingParams(temperature=0.0, bad_words_token_ids=[[7], [9]]), [7], [])
    logits = torch.zeros(1, V)
    logits[0, 7], logits[0, 9], logits[0, 12] = 5.0, 4.0, 3.0
    zeros, drawn = masked(state, logits, [1], [1])
    assert zeros == [{7, 9}] and drawn.tolist() == [12]
    # One-token words read no outputs: nothing to record, but per-entry all the same.
    assert not state.counts_outputs and not state.rows_repeatable


def test_a_word_longer_than_the_outputs_so_far_does_not_match() -> None:
    # The prompt ends with the prefix, but only outputs count; then the outputs catch up.
    state = SamplingState(2, V)
    params = SamplingParams(temperature=0.0, bad_words_token_ids=[[3, 4, 5]])
    state.add_request(0, params, [1, 3, 4], [])
    logits = torch.zeros(1, V)
    assert masked(state, logits, [0], [3])[0] == [set()]
    state.record_sampled(torch.tensor([0]), torch.tensor([4]))
    assert masked(state, logits, [0], [4])[0] == [set()]  # outputs [4]: one of two
    state.record_sampled(torch.tensor([0, 0]), torch.tensor([3, 4]))
    assert masked(state, logits, [0], [6])[0] == [{5}]  # outputs [4, 3, 4]
    state.record_sampled(torch.tensor([0]), torch.tensor([5]))
    assert masked(state, logits, [0], [7])[0] == [set()]


def test_a_row_readded_after_preemption_resumes_mid_word() -> None:
    words = [[2, 3, 4, 5], [3, 8]]
    params = SamplingParams(temperature=0.0, bad_words_token_ids=words)
    logits = torch.zeros(1, V)
    live = SamplingState(4, V)
    live.add_request(0, params, [9], [])
    live.record_sampled(torch.tensor([0, 0, 0]), torch.tensor([1, 2, 3]))
    assert masked(live, logits, [0], [4])[0] == [{8}]
    # Preempted after [1, 2, 3]; re-added in another row: the window starts from the tail.
    live.remove_request(0)
    live.add_request(2, params, [9], [1, 2, 3])
    assert masked(live, logits, [2], [4])[0] == [{8}]
    live.record_sampled(torch.tensor([2]), torch.tensor([4]))
    assert masked(live, logits, [2], [5])[0] == [{5}]
    # Re-added with more outputs than the window holds: only the tail matters.
    live.add_request(3, params, [9], [7, 7, 7, 7, 7, 2, 3, 4])
    assert masked(live, logits, [3], [9])[0] == [{5}]
    live.add_request(3, params, [9], [2, 3, 4, 7])  # the same row, replaced
    assert masked(live, logits, [3], [5])[0] == [set()]


def test_the_window_grows_and_shrinks_with_the_longest_word_in_use() -> None:
    # The window is as long as the longest prefix in the state; rows already there keep
    # their latest outputs when a longer word joins and when it leaves.
    state = SamplingState(3, V)
    short = SamplingParams(temperature=0.0, bad_words_token_ids=[[5, 6]])
    state.add_request(0, short, [1], [])
    state.record_sampled(torch.tensor([0]), torch.tensor([5]))
    assert state.bad_words.window.shape[1] == 1
    long = SamplingParams(temperature=0.0, bad_words_token_ids=[[1, 2, 3, 4]])
    state.add_request(1, long, [1], [1, 2])
    logits = torch.zeros(2, V)
    assert masked(state, logits, [0, 1], [2, 3])[0] == [{6}, set()]
    assert state.bad_words.window.shape[1] == 3
    state.record_sampled(torch.tensor([1, 0]), torch.tensor([3, 7]))
    assert masked(state, logits, [0, 1], [3, 4])[0] == [set(), {4}]
    state.record_sampled(torch.tensor([0, 1]), torch.tensor([5, 9]))
    state.remove_request(1)
    assert masked(state, logits[:1], [0], [4])[0] == [{6}]
    assert state.bad_words.window.shape[1] == 1


def test_rows_without_words_stay_bit_identical() -> None:
    gen = torch.Generator().manual_seed(3)
    plain, mixed = SamplingState(6, V), SamplingState(6, V)
    for state in (plain, mixed):
        for row in range(5):
            state.add_request(row, SamplingParams(temperature=0.9, seed=row), [1], [])
    words = [[1, 2], [0], [3, 3, 3]]
    mixed.add_request(
        2, SamplingParams(temperature=0.9, seed=2, bad_words_token_ids=words), [1], []
    )
    mixed.add_request(5, SamplingParams(temperature=0.0, bad_words_token_ids=[[4, 5]]), [1], [3])
    for step in range(12):
        logits = hot_logits(gen, 6).to(torch.bfloat16)
        rows = torch.tensor([4, 2, 0, 5, 3, 1])
        positions = torch.full((6,), step + 1)
        out_mixed = mixed.sample(logits, rows, positions, return_probs=True)
        plain_rows = torch.tensor([4, 0, 3, 1])
        out_plain = plain.sample(logits[[0, 2, 4, 5]], plain_rows, positions[:4], return_probs=True)
        assert out_mixed.probs is not None and out_plain.probs is not None
        assert torch.equal(out_mixed.token_ids[[0, 2, 4, 5]], out_plain.token_ids)
        assert torch.equal(out_mixed.probs[[0, 2, 4, 5]], out_plain.probs)
        mixed.record_sampled(rows, out_mixed.token_ids)
        plain.record_sampled(plain_rows, out_plain.token_ids)


def test_words_with_banned_allowed_ids_and_logit_bias() -> None:
    state = SamplingState(4, V)
    params = SamplingParams(
        temperature=0.0,
        allowed_token_ids=[3, 4, 5, 6],
        bad_token_ids=[6],
        bad_words_token_ids=[[2, 5], [4]],
        logit_bias={5: 100.0, 3: -1.0},
    )
    state.add_request(0, params, [1], [])
    state.add_request(1, SamplingParams(temperature=0.0, bad_token_ids=[6]), [1], [])
    logits = torch.zeros(2, V)
    zeros, drawn = masked(state, logits, [0, 1], [1, 1])
    # allowed {3..6}, 6 banned, word [4] banned; [2, 5] has not matched: the bias wins.
    assert zeros[0] == set(range(V)) - {3, 5} and drawn[0] == 5
    assert zeros[1] == {6}
    state.record_sampled(torch.tensor([0, 1]), torch.tensor([2, 2]))
    zeros, drawn = masked(state, logits, [1, 0], [2, 2])
    # After 2, 5 is banned whatever its bias (-inf + 100 is -inf): only 3 is left.
    assert zeros[1] == set(range(V)) - {3} and drawn[1] == 3
    assert zeros[0] == {6}  # the other row shares no table with it


def test_remove_request_clears_the_row_and_the_stage() -> None:
    state = SamplingState(3, V)
    state.add_request(
        1, SamplingParams(temperature=0.0, bad_words_token_ids=[[2, 7], [9]]), [1], [2]
    )
    state.add_request(0, SamplingParams(temperature=0.0), [1], [])
    assert state.counts_outputs and not state.rows_repeatable
    assert not state.draws_read_no_history  # chained verify steps must wait for the host
    assert masked(state, torch.zeros(2, V), [0, 1], [1, 1])[0] == [set(), {7, 9}]
    state.remove_request(1)
    assert not state.bad_words and not state.bad_words.reads_history
    assert state.counts_outputs is False and state.rows_repeatable
    assert state.draws_read_no_history
    state.add_request(1, SamplingParams(temperature=0.0), [1], [2])
    assert masked(state, torch.zeros(2, V), [0, 1], [1, 1])[0] == [set(), set()]


def test_out_of_vocabulary_ids_and_empty_words_are_refused_before_any_change() -> None:
    state = SamplingState(2, V)
    state.add_request(0, SamplingParams(bad_words_token_ids=[[1, 2]]), [1], [])
    with pytest.raises(ValueError, match="bad_words_token_ids"):
        state.add_request(0, SamplingParams(bad_words_token_ids=[[1, V]]), [1], [])
    empty = SamplingParams().model_copy(update={"bad_words_token_ids": [[3], []]})  # unvalidated
    with pytest.raises(ValueError, match="bad_words_token_ids"):
        state.add_request(0, empty, [1], [])
    assert 0 in state.bad_words  # the row's request is still the one before
