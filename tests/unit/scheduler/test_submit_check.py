"""What the scheduler refuses in a SubmitRequest before it reaches an encoder or a write."""

from __future__ import annotations

import msgpack
import pytest

from services.scheduler.submit_check import (
    reply_stream_error,
    salvage_submit,
    submit_refusal,
    token_ids_error,
)
from shared.codec import encode
from shared.protocol import SamplingParams, SubmitRequest
from shared.streams import Streams

STREAMS = Streams("c1")
REPLY = STREAMS.replies("gw-1")
VOCAB = 100


def submit(prompt: list[int] | None = None, **sampling: object) -> SubmitRequest:
    return SubmitRequest(
        request_id="r1",
        prompt_token_ids=prompt or [1, 2, 3],
        sampling=SamplingParams(**sampling),  # type: ignore[arg-type]
        reply_stream=REPLY,
    )


@pytest.mark.parametrize(
    "stream",
    [
        "meshllm:c1:requests",  # a stream the scheduler may write, but not a reply stream
        "meshllm:c2:replies:gw-1",  # another cluster's
        "meshllm:c1:replies:",  # the namespace without an id
        "r",
        "meshllm:c1:replies:" + "x" * 600,
    ],
)
def test_reply_streams_outside_the_gateway_namespace_are_refused(stream: str) -> None:
    assert reply_stream_error(stream, STREAMS) is not None


def test_a_gateway_reply_stream_is_accepted() -> None:
    assert reply_stream_error(REPLY, STREAMS) is None


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        (submit([1, VOCAB]), "prompt_token_ids"),
        (submit([1, -1]), "prompt_token_ids"),
        (submit(stop_token_ids=[VOCAB + 5]), "stop_token_ids"),
        (submit(bad_token_ids=[VOCAB]), "bad_token_ids"),
        (submit(allowed_token_ids=[3, VOCAB]), "allowed_token_ids"),
        (submit(logit_bias={VOCAB: 1.0}), "logit_bias"),
        (submit(logprobs=VOCAB + 1), "logprobs"),
    ],
)
def test_token_ids_outside_the_vocabulary_are_named(request_: SubmitRequest, field: str) -> None:
    error = token_ids_error(request_, VOCAB)
    assert error is not None and field in error


def test_the_boundary_ids_are_valid() -> None:
    ok = submit([0, VOCAB - 1], stop_token_ids=[VOCAB - 1], logit_bias={0: 1.0}, logprobs=VOCAB)
    assert token_ids_error(ok, VOCAB) is None


def test_an_unknown_vocabulary_still_refuses_negative_ids() -> None:
    assert token_ids_error(submit([10**6]), 0) is None
    assert token_ids_error(submit([-3]), 0) is not None


def test_refusals_in_order_reply_stream_first() -> None:
    bad_stream = submit([VOCAB + 1]).model_copy(update={"reply_stream": "elsewhere"})
    refusal = submit_refusal(bad_stream, 1, streams=STREAMS, vocab_size=VOCAB, max_deliveries=3)
    assert refusal is not None and refusal.reason == "invalid_reply_stream"
    assert refusal.reply_stream is None  # nobody to tell: that stream is the problem

    refusal = submit_refusal(
        submit([VOCAB + 1]), 1, streams=STREAMS, vocab_size=VOCAB, max_deliveries=3
    )
    assert refusal is not None and refusal.reason == "invalid_request"
    assert refusal.reply_stream == REPLY


def test_the_delivery_bound_is_exclusive() -> None:
    at_bound = submit_refusal(submit(), 3, streams=STREAMS, vocab_size=VOCAB, max_deliveries=3)
    assert at_bound is None
    past = submit_refusal(submit(), 4, streams=STREAMS, vocab_size=VOCAB, max_deliveries=3)
    assert past is not None and past.reason == "max_deliveries" and "4 times" in past.detail


def test_salvage_reads_the_ids_of_an_entry_that_does_not_decode() -> None:
    body = {"request_id": "r9", "prompt_token_ids": [2**40], "reply_stream": REPLY}
    payload = msgpack.packb({"t": "submit", "v": 1, "b": body})
    assert salvage_submit(payload) == ("r9", REPLY)


@pytest.mark.parametrize(
    "payload",
    [
        b"\xc1 not msgpack",
        msgpack.packb([1, 2]),
        msgpack.packb({"t": "abort", "v": 1, "b": {"request_id": "r", "reply_stream": REPLY}}),
        msgpack.packb({"t": "submit", "v": 1, "b": {"request_id": 5, "reply_stream": REPLY}}),
        msgpack.packb({"t": "submit", "v": 1, "b": {"request_id": "r"}}),
        msgpack.packb({"t": "submit", "v": 1, "b": "body"}),
    ],
)
def test_salvage_gives_up_on_anything_else(payload: bytes) -> None:
    assert salvage_submit(payload) is None


def test_salvage_of_a_valid_entry_agrees_with_its_decoding() -> None:
    assert salvage_submit(encode(submit())) == ("r1", REPLY)
