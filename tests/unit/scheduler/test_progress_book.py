"""Which progress checkpoints a round writes and deletes: only requests whose output grew,
never an empty one, a finished request's field deleted once, a released one's kept."""

from __future__ import annotations

from services.scheduler.progress_book import Progress, ProgressBook, Round

KEY = "meshllm:t:{g1}:requests:progress"


def live(rid: str, outputs: list[int], key: str = KEY) -> Progress:
    return Progress(rid, key, 5, outputs)


def written(r: Round) -> dict[str, list[int]]:
    return {c.request_id: list(c.output_token_ids) for _, c in r.writes}


def test_a_round_writes_only_the_requests_whose_output_grew() -> None:
    book = ProgressBook("s1", "inc")
    a, b, c = [11, 12], [21], []
    first = book.round([live("a", a), live("b", b), live("c", c)])
    assert written(first) == {"a": [11, 12], "b": [21]}  # c has nothing to resume from
    assert first.deletes == [] and all(k == KEY for k, _ in first.writes)
    checkpoint = first.writes[0][1]
    assert (checkpoint.num_prompt_tokens, checkpoint.scheduler_id) == (5, "s1")
    assert checkpoint.incarnation == "inc"
    assert not book.round([live("a", a), live("b", b), live("c", c)])  # nothing grew
    a.append(13)
    c.append(31)
    assert written(book.round([live("a", a), live("b", b), live("c", c)])) == {
        "a": [11, 12, 13],
        "c": [31],
    }


def test_a_finished_request_is_deleted_once_and_a_released_one_kept() -> None:
    book = ProgressBook("s1", "inc")
    book.round([live("a", [1]), live("b", [2]), live("c", [3], key="other")])
    book.finished("a")
    book.finished("c")
    book.released("b")  # another group resumes from its field
    book.finished("never-written")
    r = book.round([])
    assert sorted(r.deletes) == [(KEY, "a"), ("other", "c")] and r.writes == []
    assert not book.round([])  # deleted once
    assert "b" not in book


def test_a_resumed_request_is_written_again_only_when_it_grows() -> None:
    book = ProgressBook("s2", "inc2")
    book.resumed("a", KEY, 2)
    book.resumed("v", KEY, -1)  # its checkpoint was void: ours to overwrite and delete
    assert written(book.round([live("a", [1, 2]), live("v", [])])) == {}
    assert written(book.round([live("a", [1, 2, 3]), live("v", [9])])) == {
        "a": [1, 2, 3],
        "v": [9],
    }
    book.resumed("z", KEY, -1)
    book.finished("z")  # finished before its first write: the void field goes
    assert book.round([]).deletes == [(KEY, "z")]


def test_a_failed_round_is_written_again() -> None:
    book = ProgressBook("s1", "inc")
    book.round([live("gone", [1])])
    book.finished("gone")
    lost = book.round([live("a", [1, 2])])
    assert written(lost) == {"a": [1, 2]} and lost.deletes == [(KEY, "gone")]
    book.failed(lost)
    again = book.round([live("a", [1, 2])])
    assert written(again) == {"a": [1, 2]} and again.deletes == [(KEY, "gone")]
