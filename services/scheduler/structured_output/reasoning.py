"""The constraint start: where, in a window of tokens, the grammar starts to apply.

A reasoning model first thinks freely, then ends its reasoning with a marker (e.g. `</think>`)
and only then writes the structured answer, so the grammar must not constrain the tokens before
the marker, nor the marker itself. One pure function answers the question for the three uses
(validating drafts, filling bitmask rows, accepting tokens), so they can never disagree:

- 0 when reasoning is not in play: no reasoning marker configured (no parser),
  `enable_in_reasoning` (the grammar constrains the reasoning too), or reasoning already ended
  (the latch; initialised from the prompt on first use, e.g. a chat template that closed the
  think block itself);
- otherwise the index after the LAST marker that ends inside the window, found scanning from
  the end backwards;
- otherwise the sentinel `len(window) + 1` (never None): index i is constrained iff i >= start,
  so no token of the window is, and neither is the bonus row at index len(window).

Detection is stateless: the same (history, window) always gives the same answer. A marker may
span the boundary between history and window (a multi-token marker whose last tokens were
just sampled); it counts for the window when its last token is in it.
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict


class ReasoningConfig(BaseModel):
    """How reasoning is delimited for the served model (the reasoning parser's markers)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # Token ids of the reasoning-end marker (`</think>`); empty = no reasoning parser.
    end_token_ids: tuple[int, ...] = ()
    # Token ids of the reasoning-start marker (`<think>`); only used to read the prompt: with
    # it, a prompt has ended reasoning iff its last end marker comes after its last start
    # marker (a multi-turn history holds earlier turns' markers).
    start_token_ids: tuple[int, ...] = ()
    # Constrain the reasoning too (the grammar applies from the first output token).
    enable_in_reasoning: bool = False

    @property
    def has_parser(self) -> bool:
        return bool(self.end_token_ids)


def constraint_start(
    window: Sequence[int],
    *,
    history: Sequence[int],
    marker: Sequence[int],
    reasoning_in_play: bool,
) -> int:
    """The index in `window` from which the grammar applies (see module docstring).

    `history` is every token before the window (prompt and accepted outputs); only its last
    `len(marker) - 1` tokens are read, for markers spanning the boundary."""
    if not reasoning_in_play or not marker:
        return 0
    for end in range(len(window) - 1, -1, -1):
        if _marker_ends_at(window, history, end, marker):
            return end + 1
    return len(window) + 1


def reasoning_ended(tokens: Sequence[int], config: ReasoningConfig) -> bool:
    """Whether `tokens` (a prompt) leave reasoning closed: an end marker after any start
    marker. Without a start marker configured, any end marker closes it."""
    end = _last_marker_end(tokens, config.end_token_ids)
    if end < 0:
        return False
    return end > _last_marker_end(tokens, config.start_token_ids)


def _marker_ends_at(
    window: Sequence[int], history: Sequence[int], end: int, marker: Sequence[int]
) -> bool:
    """Whether `marker` occupies the positions ending at window index `end`; positions before
    the window are read from the tail of `history`."""
    n = len(marker)
    for k in range(n):
        i = end - k  # window index of the marker's (n-1-k)-th token
        if i >= 0:
            token = window[i]
        else:
            h = len(history) + i
            if h < 0:
                return False
            token = history[h]
        if token != marker[n - 1 - k]:
            return False
    return True


def _last_marker_end(tokens: Sequence[int], marker: Sequence[int]) -> int:
    """Index of the last token of the last occurrence of `marker` in `tokens`, or -1."""
    n = len(marker)
    if n == 0:
        return -1
    first = marker[-1]
    for end in range(len(tokens) - 1, n - 2, -1):
        if tokens[end] == first and list(tokens[end - n + 1 : end + 1]) == list(marker):
            return end
    return -1
