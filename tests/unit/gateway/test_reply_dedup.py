"""Re-delivered output (a restarted scheduler regenerating) is dropped by output index."""

from __future__ import annotations

import pytest

from services.gateway.stream.reply_dedup import MalformedDelta, ReplyCursor
from shared.protocol import RequestDelta


def delta(start: int, tokens: list[int], **kw: object) -> RequestDelta:
    return RequestDelta(request_id="r-0", start_index=start, token_ids=tokens, **kw)  # type: ignore[arg-type]


def test_full_duplicate_dropped_partial_overlap_trimmed() -> None:
    cursor = ReplyCursor("r-0")
    assert cursor.fresh(delta(0, [10, 11])) is not None
    assert cursor.fresh(delta(0, [10, 11])) is None
    fresh = cursor.fresh(
        delta(
            1,
            [11, 12, 13],
            logprobs=[-0.1, -0.2, -0.3],
            top_token_ids=[11, 5, 12, 6, 13, 7],
            top_logprobs=[-0.1, -1, -0.2, -2, -0.3, -3],
        )
    )
    assert fresh is not None
    assert (fresh.start_index, fresh.token_ids) == (2, [12, 13])
    assert fresh.logprobs == pytest.approx([-0.2, -0.3])
    assert fresh.top_token_ids == [12, 6, 13, 7]
    assert cursor.next_index == 4


def test_finish_on_an_already_seen_delta_still_finishes() -> None:
    cursor = ReplyCursor("r-0")
    cursor.fresh(delta(0, [1, 2]))
    fresh = cursor.fresh(delta(0, [1, 2], finish_reason="stop", stop_token_id=2))
    assert fresh is not None and fresh.token_ids == [] and fresh.finish_reason == "stop"
    assert cursor.finished
    assert cursor.fresh(delta(2, [3])) is None  # nothing after the end


def test_routed_rows_trimmed_with_tokens_and_prompt_rows_delivered_once() -> None:
    # 2 prompt rows + 2 token rows, 1 layer, top-2: row r holds experts [r, r + 10].
    def rows(*ids: int) -> list[int]:
        return [v for r in ids for v in (r, r + 10)]

    first = delta(0, [7, 8], routed_experts=rows(0, 1, 2, 3), routed_experts_shape=[4, 1, 2])
    cursor = ReplyCursor("r-0")
    assert cursor.fresh(first) == first
    # The regenerated first delta and one more token: only the new token's row survives.
    again = delta(0, [7, 8, 9], routed_experts=rows(0, 1, 2, 3, 4), routed_experts_shape=[5, 1, 2])
    fresh = cursor.fresh(again)
    assert fresh is not None and fresh.token_ids == [9]
    assert fresh.routed_experts == rows(4) and fresh.routed_experts_shape == [1, 1, 2]


def test_prompt_rows_only_in_the_first_delta() -> None:
    cursor = ReplyCursor("r-0")
    cursor.fresh(delta(0, [1]))
    with pytest.raises(MalformedDelta):
        cursor.fresh(delta(1, [2], routed_experts=[0, 1, 2, 3], routed_experts_shape=[2, 1, 2]))


@pytest.mark.parametrize(
    "bad",
    [
        {"logprobs": [-0.1]},
        {"top_token_ids": [1, 2, 3], "top_logprobs": [-1.0, -2.0, -3.0]},
        {"top_token_ids": [1, 2]},
        {"routed_experts": [1, 2, 3], "routed_experts_shape": [2, 1, 2]},
    ],
)
def test_inconsistent_arrays_are_malformed(bad: dict[str, object]) -> None:
    with pytest.raises(MalformedDelta):
        ReplyCursor("r-0").fresh(delta(0, [5, 6], **bad))
