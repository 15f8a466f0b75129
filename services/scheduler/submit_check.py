"""What the scheduler checks in a SubmitRequest before any of it reaches an encoder or a write.

The codec has already checked types, int32 ranges and sizes (shared/protocol). What only the
scheduler can check is here: token ids inside the model's vocabulary (it knows the vocabulary
from WorkerReady), and a reply stream inside the gateways' reply namespace of its cluster (its
Redis user may write nothing else there: a TokenDelta XADD elsewhere is refused, and one
refused write must not cost a step). A gateway never sends such a request; a foreign or buggy
producer may, and then the request is dead-lettered and, when its reply stream is usable,
answered with the error.

`salvage_submit` reads the request id and reply stream out of a submit entry that did not
decode at all, so even that producer's client hears why instead of waiting for a timeout.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import msgpack

from shared.protocol import SubmitRequest
from shared.protocol.requests import MAX_STREAM_NAME
from shared.streams import Streams


def reply_stream_error(reply_stream: str, streams: Streams) -> str | None:
    """Why the scheduler may not write to `reply_stream`, or None (a gateway's reply stream)."""
    prefix = streams.replies("")
    if len(reply_stream) > MAX_STREAM_NAME:
        return f"reply_stream is longer than {MAX_STREAM_NAME} characters"
    if not reply_stream.startswith(prefix) or len(reply_stream) == len(prefix):
        return f"reply_stream {reply_stream[:100]!r} is not a gateway reply stream ({prefix}<id>)"
    return None


def token_ids_error(msg: SubmitRequest, vocab_size: int) -> str | None:
    """Why a token id of the request is unusable, or None. `vocab_size` 0 (no worker announced
    yet): only negative ids are refused; the core checks again once it knows the vocabulary."""
    sampling = msg.sampling
    lists: list[tuple[str, Iterable[int]]] = [
        ("prompt_token_ids", msg.prompt_token_ids),
        ("sampling.stop_token_ids", sampling.stop_token_ids),
        ("sampling.bad_token_ids", sampling.bad_token_ids),
        ("sampling.allowed_token_ids", sampling.allowed_token_ids or ()),
        ("sampling.logit_bias", sampling.logit_bias.keys()),
        (
            "sampling.bad_words_token_ids",
            (t for word in sampling.bad_words_token_ids for t in word),
        ),
    ]
    for field, ids in lists:
        ids = list(ids)
        if not ids:
            continue
        low, high = min(ids), max(ids)
        if low < 0:
            return f"{field} holds token id {low}, which is negative"
        if vocab_size and high >= vocab_size:
            return f"{field} holds token id {high}, outside the vocabulary [0, {vocab_size})"
    if vocab_size and sampling.logprobs is not None and sampling.logprobs > vocab_size:
        return f"sampling.logprobs {sampling.logprobs} exceeds the vocabulary size {vocab_size}"
    return None


def salvage_submit(payload: bytes) -> tuple[str, str] | None:
    """(request id, reply stream) of an undecodable submit entry whose envelope still names
    both as strings; None for anything else. Never raises: the payload is arbitrary bytes."""
    try:
        envelope: Any = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception:
        return None
    if not isinstance(envelope, dict) or envelope.get("t") != SubmitRequest.TYPE:
        return None
    body = envelope.get("b")
    if not isinstance(body, dict):
        return None
    request_id, reply_stream = body.get("request_id"), body.get("reply_stream")
    if not isinstance(request_id, str) or not isinstance(reply_stream, str) or not request_id:
        return None
    return request_id[:256], reply_stream


@dataclass(frozen=True)
class Refusal:
    """Why a submit entry is dead-lettered instead of run; `reply_stream` is where its client
    hears the error, None when that stream is itself the problem."""

    reason: str
    detail: str
    reply_stream: str | None


def submit_refusal(
    msg: SubmitRequest,
    deliveries: int,
    *,
    streams: Streams,
    vocab_size: int,
    max_deliveries: int,
) -> Refusal | None:
    """The refusal of a decoded submit entry, or None when it may run. An entry delivered more
    than `max_deliveries` times is one its schedulers kept dying on (each restart or claim
    delivers it again): it goes, or it would take every scheduler down in turn."""
    if error := reply_stream_error(msg.reply_stream, streams):
        return Refusal("invalid_reply_stream", error, None)
    if deliveries > max_deliveries:
        detail = (
            f"delivered {deliveries} times (at most {max_deliveries}): the schedulers that "
            "read it kept failing before finishing it"
        )
        return Refusal("max_deliveries", detail, msg.reply_stream)
    if error := token_ids_error(msg, vocab_size):
        return Refusal("invalid_request", error, msg.reply_stream)
    return None
