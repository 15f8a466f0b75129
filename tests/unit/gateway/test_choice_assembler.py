"""A choice assembled from deltas of real token ids: text, counts, stop handling, logprobs."""

from __future__ import annotations

from services.gateway.plan.tokenization import PromptTokenizer
from services.gateway.stream.choice_assembler import ChoiceAssembler
from services.gateway.stream.generation import engine_error_status
from shared.protocol import RequestDelta

EOS = 2


def assembler(tok: PromptTokenizer, stop: list[str] | None = None, **kw: bool) -> ChoiceAssembler:
    prompt = tok.encode("Q:", add_special_tokens=False)
    options = {"logprobs": False, "routed_experts": False, **kw}
    return ChoiceAssembler(0, tok, prompt, stop=stop or [], **options)


def deltas(ids: list[int], size: int, **last: object) -> list[RequestDelta]:
    out = []
    for start in range(0, len(ids), size):
        extra = last if start + size >= len(ids) else {}
        out.append(
            RequestDelta(
                request_id="x", start_index=start, token_ids=ids[start : start + size], **extra
            )
        )  # type: ignore[arg-type]
    return out


def test_text_equals_decode_and_eos_counted_not_rendered(tokenizer: PromptTokenizer) -> None:
    ids = [*tokenizer.encode(" Paris is the capital 🇫🇷.", add_special_tokens=False), EOS]
    choice = assembler(tokenizer)
    for d in deltas(ids, 3, finish_reason="stop", stop_token_id=EOS):
        choice.consume(d)
    assert choice.text == tokenizer.decode(ids[:-1]) == " Paris is the capital 🇫🇷."
    assert choice.num_tokens == len(ids)
    assert choice.finish_reason == "stop"


def stopped_on_last(ids: list[int]) -> RequestDelta:
    """All of `ids` in one delta, the last one the stop token that finished it."""
    return RequestDelta(
        request_id="x", start_index=0, token_ids=ids, finish_reason="stop", stop_token_id=ids[-1]
    )


def test_non_special_stop_token_id_is_not_rendered(tokenizer: PromptTokenizer) -> None:
    ids = tokenizer.encode(" one two.", add_special_tokens=False)
    choice = assembler(tokenizer)
    choice.consume(stopped_on_last(ids))
    assert choice.text == tokenizer.decode(ids[:-1])
    assert choice.num_tokens == len(ids)


def test_stop_string_across_deltas_ends_the_choice(tokenizer: PromptTokenizer) -> None:
    text = " alpha beta END gamma delta"
    ids = tokenizer.encode(text, add_special_tokens=False)
    choice = assembler(tokenizer, stop=["END"])
    updates = [choice.consume(d) for d in deltas(ids, 1)]
    stopped = [u for u in updates if u.stopped_on_string]
    assert len(stopped) == 1 and stopped[0].finish_reason == "stop"
    assert choice.text == " alpha beta "
    # Tokens up to the one completing "END" are counted; later ones are not.
    upto = next(i for i in range(len(ids)) if "END" in tokenizer.decode(ids[: i + 1]))
    assert choice.num_tokens == upto + 1
    assert all(u.text == "" and u.finish_reason is None for u in updates[upto + 1 :])


def test_held_text_released_on_length_finish(tokenizer: PromptTokenizer) -> None:
    ids = tokenizer.encode(" ends with EN", add_special_tokens=False)
    choice = assembler(tokenizer, stop=["END"])
    for d in deltas(ids, 2, finish_reason="length"):
        choice.consume(d)
    assert choice.text == " ends with EN" and choice.finish_reason == "length"


def test_logprobs_and_top_alternatives_per_token(tokenizer: PromptTokenizer) -> None:
    ids = tokenizer.encode(" hi there", add_special_tokens=False)
    n = len(ids)
    choice = assembler(tokenizer, logprobs=True)
    choice.consume(
        RequestDelta(
            request_id="x",
            start_index=0,
            token_ids=ids,
            logprobs=[-0.5] * n,
            top_token_ids=[t for i in ids for t in (i, 7)],
            top_logprobs=[-0.5, -3.0] * n,
            finish_reason="length",
        )
    )
    assert [e.token_id for e in choice.logprobs] == ids
    assert all(e.top == [(t, -0.5), (7, -3.0)] for e, t in zip(choice.logprobs, ids, strict=True))


def test_missing_logprobs_is_an_error_not_a_crash(tokenizer: PromptTokenizer) -> None:
    choice = assembler(tokenizer, logprobs=True)
    update = choice.consume(RequestDelta(request_id="x", start_index=0, token_ids=[5]))
    assert update.finish_reason == "error" and update.error


def test_an_engine_error_keeps_whose_fault_it_is(tokenizer: PromptTokenizer) -> None:
    """An error the request caused (its grammar allows no token) is a 400; any other, a 500."""
    for error_type, status in (("invalid_request_error", 400), (None, 500)):
        delta = RequestDelta(
            request_id="x", start_index=0, finish_reason="error", error="no", error_type=error_type
        )
        update = assembler(tokenizer).consume(delta)
        assert update.finish_reason == "error" and update.error == "no"
        assert engine_error_status(update)[0] == status
    # An engine error without a message still fails the choice, as an internal error.
    update = assembler(tokenizer).consume(
        RequestDelta(request_id="x", start_index=0, finish_reason="error")
    )
    assert update.error and engine_error_status(update) == (500, "internal_server_error")


def test_routed_rows_nested_per_position_and_layer(tokenizer: PromptTokenizer) -> None:
    # 1 prompt row + 2 token rows, 2 layers, top-2.
    flat = list(range(12))
    choice = assembler(tokenizer, routed_experts=True)
    choice.consume(
        RequestDelta(
            request_id="x",
            start_index=0,
            token_ids=[100, 101],
            routed_experts=flat,
            routed_experts_shape=[3, 2, 2],
            finish_reason="length",
        )
    )
    assert choice.routed_rows == [[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[8, 9], [10, 11]]]


def test_prompt_logprobs_come_with_the_first_delta_and_must_fit_the_prompt(
    tokenizer: PromptTokenizer,
) -> None:
    prompt = tokenizer.encode("Q:", add_special_tokens=False)
    assert len(prompt) == 2
    choice = assembler(tokenizer, logprobs=True, prompt_logprobs=True)
    first = RequestDelta(
        request_id="x", start_index=0, token_ids=[5], logprobs=[-0.1],
        prompt_logprobs=[-2.5], prompt_top_token_ids=[9, prompt[1]],
        prompt_top_logprobs=[-0.5, -2.5],
    )  # fmt: skip
    assert choice.consume(first).error is None
    (entry,) = choice.prompt_logprobs
    assert (entry.token_id, entry.logprob, entry.top) == (
        prompt[1],
        -2.5,
        [(9, -0.5), (prompt[1], -2.5)],
    )
    for wrong in ({}, {"prompt_logprobs": [-2.5, -1.0]}):  # none, or more than the prompt has
        bad = assembler(tokenizer, logprobs=True, prompt_logprobs=True)
        delta = RequestDelta(request_id="x", start_index=0, token_ids=[5], logprobs=[-0.1], **wrong)
        update = bad.consume(delta)  # type: ignore[arg-type]
        assert update.finish_reason == "error" and "prompt logprobs" in (update.error or "")


def test_included_stop_token_and_stop_string(tokenizer: PromptTokenizer) -> None:
    """include_stop_str_in_output: a normal stop token is rendered, eos (special) still renders
    as nothing, and a stop string stays in the text."""
    ids = tokenizer.encode(" one two.", add_special_tokens=False)
    choice = assembler(tokenizer, include_stop=True)
    choice.consume(stopped_on_last(ids))
    assert choice.text == tokenizer.decode(ids) == " one two."
    choice = assembler(tokenizer, include_stop=True)
    for d in deltas([*ids, EOS], 2, finish_reason="stop", stop_token_id=EOS):
        choice.consume(d)
    assert choice.text == " one two."
    choice = assembler(tokenizer, stop=["two"], include_stop=True)
    for d in deltas(ids, 1, finish_reason="length"):
        choice.consume(d)
    assert choice.text == " one two" and choice.finish_reason == "stop"


def test_special_tokens_kept_when_not_skipped(tokenizer: PromptTokenizer) -> None:
    im_start = tokenizer.hf.convert_tokens_to_ids("<|im_start|>")
    ids = [*tokenizer.encode(" a", add_special_tokens=False), im_start, EOS]
    kept = assembler(tokenizer, skip_special_tokens=False)
    skipped = assembler(tokenizer)
    for d in deltas(ids, 2, finish_reason="stop", stop_token_id=EOS):
        kept.consume(d)
        skipped.consume(d)
    assert kept.text == " a<|im_start|>"  # the eos that stopped it is still not rendered
    assert skipped.text == " a"
