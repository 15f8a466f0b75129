"""Prompt-lookup drafting: longest suffix n-gram, latest earlier occurrence, K capped; the C++
search and the NumPy one give the same drafts (every rule test runs on both)."""

from __future__ import annotations

import numpy as np
import pytest

from meshllm_kernels.runtime.cpu_library import KernelUnavailable
from meshllm_kernels.spec import ngram_lookup
from services.worker.spec.ngram import NgramProposer

NATIVE = True


@pytest.fixture(autouse=True, params=["cpp", "numpy"])
def search(request: pytest.FixtureRequest) -> None:
    global NATIVE
    NATIVE = request.param == "cpp"
    if NATIVE:
        assert NgramProposer().lookup is not None  # g++ is part of the test machine


def proposer(min_n: int, max_n: int) -> NgramProposer:
    return NgramProposer(min_n, max_n, native=NATIVE)


def propose_one(proposer: NgramProposer, tokens: np.ndarray, k: int) -> list[int]:
    """The proposal for a batch of one row."""
    one = np.zeros(1, dtype=np.int64)
    return proposer.propose(tokens[None, :], one, one + len(tokens), one + k)[0]


def propose(tokens: list[int], k: int = 3, min_n: int = 1, max_n: int = 3) -> list[int]:
    return propose_one(proposer(min_n, max_n), np.array(tokens, dtype=np.int32), k)


def test_copies_what_followed_the_earlier_occurrence() -> None:
    assert propose([5, 6, 7, 8, 9, 1, 5, 6]) == [7, 8, 9]


def test_longest_suffix_wins_over_a_more_recent_shorter_match() -> None:
    # "6" alone last occurred before 40; "5 6" occurred before 7.
    tokens = [5, 6, 7, 8, 3, 6, 40, 41, 5, 6]
    assert propose(tokens, k=2) == [7, 8]
    assert propose(tokens, k=2, max_n=1) == [40, 41]


def test_latest_occurrence_of_the_same_length_wins() -> None:
    assert propose([1, 2, 10, 11, 1, 2, 20, 21, 9, 1, 2], k=2, min_n=2) == [20, 21]


def test_no_match_or_below_min_n_proposes_nothing() -> None:
    assert propose([1, 2, 3, 4]) == []
    assert propose([7, 1, 8, 1], min_n=2) == []
    assert propose([7]) == []


def test_drafts_are_cut_at_the_end_of_the_tokens_and_at_k() -> None:
    # The only earlier "3 4" is two tokens from the end: one token follows it before the suffix.
    assert propose([3, 4, 3, 4], k=5, min_n=2) == [3, 4]
    assert propose([*range(10), 0, 1], k=4, min_n=2) == [2, 3, 4, 5]
    tokens = np.array([*range(10), 0, 1], dtype=np.int32)
    assert propose_one(proposer(1, 3), tokens, k=0) == []


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError):
        NgramProposer(min_n=3, max_n=2)
    with pytest.raises(ValueError):
        NgramProposer(min_n=0, max_n=2)


def window_scan(tokens: np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """The rule as first written: for n from max_n down, scan every window of the tokens
    before the last for the suffix n-gram; the latest hit's continuation."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: length - 1], n)
        hits = np.flatnonzero((windows == tokens[length - n :]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start : start + k].tolist()  # type: ignore[no-any-return]
    return []


def test_the_single_pass_equals_the_window_scan_on_random_token_runs() -> None:
    rng = np.random.default_rng(7)
    proposed = 0
    for _ in range(3000):
        alphabet = int(rng.integers(2, 6))  # few symbols: many repeats and long matches
        tokens = rng.integers(0, alphabet, int(rng.integers(0, 40))).astype(np.int32)
        min_n = int(rng.integers(1, 4))
        max_n = int(rng.integers(min_n, 7))
        k = int(rng.integers(1, 6))
        got = propose_one(proposer(min_n, max_n), tokens, k)
        assert got == window_scan(tokens, k, min_n, max_n), (tokens.tolist(), k, min_n, max_n)
        proposed += bool(got)
    assert proposed > 1000  # the cases exercised the matching, not only the empty answer


def test_a_batch_proposes_for_each_row_what_the_window_scan_finds_for_it_alone() -> None:
    """Rows of different lengths and K (0 included) picked out of one array, with junk past
    each row's end: no row's lookup sees another row's tokens or its own beyond its length."""
    rng = np.random.default_rng(11)
    proposed = 0
    for _ in range(300):
        num_rows = int(rng.integers(1, 9))
        min_n = int(rng.integers(1, 4))
        max_n = int(rng.integers(min_n, 7))
        token_ids = rng.integers(0, 4, (num_rows + 3, 48)).astype(np.int32)
        rows = rng.permutation(num_rows + 3)[:num_rows]  # a batch's rows: any order, gaps
        lengths = rng.integers(0, 48, num_rows)
        ks = rng.integers(0, 6, num_rows)
        got = proposer(min_n, max_n).propose(token_ids, rows, lengths, ks)
        for i in range(num_rows):
            tokens = token_ids[rows[i], : lengths[i]]
            want = window_scan(tokens, int(ks[i]), min_n, max_n) if ks[i] else []
            assert got[i] == want, (tokens.tolist(), int(ks[i]), min_n, max_n)
            proposed += bool(got[i])
    assert proposed > 300


def test_the_cpp_search_refuses_indices_outside_the_tokens() -> None:
    lookup = ngram_lookup.load()
    token_ids = np.zeros((2, 8), dtype=np.int32)
    one = np.ones(1, dtype=np.int64)
    with pytest.raises(ValueError, match="outside"):
        lookup(token_ids, one * 2, one, one, 1, 2)  # row 2 of 2
    with pytest.raises(ValueError, match="outside"):
        lookup(token_ids, one, one * 9, one, 1, 2)  # 9 tokens of 8
    with pytest.raises(ValueError, match="int32"):
        lookup(token_ids.astype(np.int64), one, one, one, 1, 2)


def test_without_a_compiler_the_numpy_search_serves(monkeypatch: pytest.MonkeyPatch) -> None:
    def unavailable() -> None:
        raise KernelUnavailable("no C++ compiler (test)")

    monkeypatch.setattr(ngram_lookup, "load", unavailable)
    fallback = NgramProposer(1, 3)
    assert fallback.lookup is None
    assert propose_one(fallback, np.array([5, 6, 7, 8, 5, 6], dtype=np.int32), 2) == [7, 8]
