"""Keep only the output a request has not delivered yet.

Replies are at-least-once: a scheduler that restarts regenerates a request from the start
(seeded, so the same tokens) and sends deltas whose output indexes were already seen. Each
sub-request has a cursor; a delta is trimmed to the indexes at or past it.

Routed-experts rows follow one layout (fixed by the gateway's response shape): a delta carries
one row per token in `token_ids`, and the delta with `start_index == 0` also carries, before
those, the prompt rows (positions `routed_experts_prompt_start .. prompt_len - 1`). Rows are
trimmed with their tokens, and prompt rows are delivered once.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from shared.protocol import RequestDelta

log = logging.getLogger(__name__)


class MalformedDelta(ValueError):
    """A delta whose arrays disagree in length: a scheduler bug, reported on the request."""


@dataclass
class ReplyCursor:
    request_id: str
    next_index: int = 0  # output indexes below this were delivered
    prompt_rows_seen: bool = False
    finished: bool = False

    def fresh(self, delta: RequestDelta) -> RequestDelta | None:
        """The unseen part of `delta`, or None when it brings nothing new."""
        if self.finished:
            return None
        n = len(delta.token_ids)
        _check_arrays(delta)
        token_rows, prompt_rows = _routed_rows(delta)
        skip = self.next_index - delta.start_index
        if skip < 0:
            log.error(
                "reply for %s starts at output index %d but %d were seen: %d tokens missing",
                self.request_id,
                delta.start_index,
                self.next_index,
                -skip,
            )
            skip = 0
        keep_prompt_rows = prompt_rows > 0 and not self.prompt_rows_seen
        ends = delta.finish_reason is not None or delta.error is not None
        if skip >= n and not ends and not keep_prompt_rows:
            return None
        skip = min(skip, n)
        self.next_index = delta.start_index + n if n > skip else self.next_index
        self.prompt_rows_seen = self.prompt_rows_seen or prompt_rows > 0
        self.finished = ends
        if skip == 0 and (keep_prompt_rows or prompt_rows == 0):
            return delta
        return _trim(delta, skip, prompt_rows if keep_prompt_rows else 0, token_rows)


def _check_arrays(delta: RequestDelta) -> None:
    n = len(delta.token_ids)
    if delta.logprobs is not None and len(delta.logprobs) != n:
        raise MalformedDelta(f"{len(delta.logprobs)} logprobs for {n} tokens")
    top_ids, top_lps = delta.top_token_ids, delta.top_logprobs
    if (top_ids is None) != (top_lps is None):
        raise MalformedDelta("top_token_ids and top_logprobs come together")
    if (
        top_ids is not None
        and top_lps is not None
        and (len(top_ids) != len(top_lps) or (len(top_ids) % n if n else len(top_ids)))
    ):
        raise MalformedDelta(f"{len(top_ids)} top ids / {len(top_lps)} top logprobs for {n}")


def _routed_rows(delta: RequestDelta) -> tuple[int, int]:
    """(rows aligned with tokens, leading prompt rows) of the delta's routed experts."""
    if delta.routed_experts is None:
        return 0, 0
    shape = delta.routed_experts_shape or []
    if len(shape) != 3 or shape[0] * shape[1] * shape[2] != len(delta.routed_experts):
        raise MalformedDelta(f"routed_experts_shape {shape} does not match the data")
    rows, n = shape[0], len(delta.token_ids)
    extra = rows - n
    if extra < 0 or (extra > 0 and delta.start_index != 0):
        raise MalformedDelta(f"{rows} routed rows for {n} tokens at index {delta.start_index}")
    return n, extra


def _trim(delta: RequestDelta, skip: int, prompt_rows: int, token_rows: int) -> RequestDelta:
    n = len(delta.token_ids)
    update: dict[str, object] = {
        "start_index": delta.start_index + skip,
        "token_ids": delta.token_ids[skip:],
    }
    if delta.logprobs is not None:
        update["logprobs"] = delta.logprobs[skip:]
    if delta.top_token_ids is not None and delta.top_logprobs is not None and n:
        k = len(delta.top_token_ids) // n
        update["top_token_ids"] = delta.top_token_ids[skip * k :]
        update["top_logprobs"] = delta.top_logprobs[skip * k :]
    if delta.routed_experts is not None and delta.routed_experts_shape is not None:
        rows, layers, top_k = delta.routed_experts_shape
        width = layers * top_k
        first_prompt_row = rows - token_rows - prompt_rows  # the prompt rows lead the array
        kept = delta.routed_experts[first_prompt_row * width : (rows - token_rows) * width]
        kept += delta.routed_experts[(rows - token_rows + skip) * width :]
        update["routed_experts"] = kept
        update["routed_experts_shape"] = [len(kept) // width if width else 0, layers, top_k]
    return delta.model_copy(update=update)
