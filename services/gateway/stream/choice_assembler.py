"""One choice's output, assembled from its (de-duplicated) deltas: text, logprobs, experts.

Per token, in order: count it, record its logprobs, render it (incremental detokenizer), run the
text through the stop-string matcher. Rules:
- The stop/eos token that finished the output counts as a completion token (as vLLM counts
  it) and keeps its logprob entry, but is not rendered as text unless the request asks for
  its stop in the output (`include_stop`, vLLM's include_stop_str_in_output; a special token
  still renders as nothing while special tokens are skipped).
- A stop string ends the choice at the token that completed it: later tokens of that delta are
  neither counted nor returned, and the text ends right before the stop string (after it, with
  `include_stop`). The caller must then abort the scheduler request (the scheduler does not
  see stop strings).
- When the output ends, the detokenizer's and the matcher's held-back text is released.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field

from services.gateway.plan.tokenization import PromptTokenizer
from services.gateway.stream.detokenizer import IncrementalDetokenizer
from services.gateway.stream.stop_strings import StopStringMatcher
from shared.protocol import RequestDelta


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the top alternatives, best first
    rank: int | None = None  # prompt tokens: the tokens at least as likely (vLLM's rank)


@dataclass
class ChoiceUpdate:
    """What one delta added to a choice (for a stream chunk)."""

    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    routed_rows: list[list[list[int]]] = field(default_factory=list)  # [pos][layer][top_k]
    finish_reason: str | None = None
    stopped_on_string: bool = False
    error: str | None = None
    error_type: str | None = None  # "invalid_request_error": the request's fault (a 400)

    def then(self, later: ChoiceUpdate) -> ChoiceUpdate:
        """This update followed by `later` (of the same choice) as one: a stream chunk for
        several deltas that were waiting together."""
        return ChoiceUpdate(
            text=self.text + later.text,
            logprobs=self.logprobs + later.logprobs,
            routed_rows=self.routed_rows + later.routed_rows,
            finish_reason=later.finish_reason,
            stopped_on_string=later.stopped_on_string,
            error=later.error,
            error_type=later.error_type,
        )


class ChoiceAssembler:
    def __init__(
        self,
        index: int,
        tokenizer: PromptTokenizer,
        prompt_ids: list[int],
        *,
        stop: list[str],
        logprobs: bool,
        routed_experts: bool,
        prompt_logprobs: bool = False,
        include_stop: bool = False,
        skip_special_tokens: bool = True,
        reasoning: bool = False,
    ) -> None:
        """`reasoning`: a reasoning parser reads the text, so count_reasoning will be asked
        (each token's text end is kept for it)."""
        self.index = index
        self._prompt_ids = prompt_ids
        self._want_prompt_logprobs = prompt_logprobs
        # One per prompt token after the first (its logprob given the tokens before it).
        self.prompt_logprobs: list[TokenLogprob] = []
        self._detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens)
        self._stops = StopStringMatcher(stop, include=include_stop)
        self._include_stop = include_stop
        self._want_logprobs = logprobs
        self._want_routed = routed_experts
        self.text = ""
        self.num_tokens = 0
        self.logprobs: list[TokenLogprob] = []
        self.routed_rows: list[list[list[int]]] = []
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.num_cached_tokens = 0
        # Output tokens that were reasoning (with a reasoning parser; count_reasoning).
        self.reasoning_tokens = 0
        # The detokenized text's length after each output token (with `reasoning` only):
        # which token wrote a char.
        self._text_ends: list[int] | None = [] if reasoning else None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def consume(self, delta: RequestDelta) -> ChoiceUpdate:
        update = ChoiceUpdate()
        if self.finished:
            return update
        self.num_cached_tokens = max(self.num_cached_tokens, delta.num_cached_tokens)
        if delta.error is not None or delta.finish_reason == "error":
            update.error_type = delta.error_type
            return self._fail(update, delta.error or "the request failed in the engine")
        if self._want_logprobs and delta.token_ids and delta.logprobs is None:
            return self._fail(update, "logprobs were requested but the engine sent none")
        if self._want_prompt_logprobs and delta.start_index == 0 and delta.token_ids:
            entries = _prompt_entries(delta, self._prompt_ids)
            if entries is None:
                return self._fail(update, "prompt logprobs were requested but the engine sent none")
            self.prompt_logprobs = entries
        rows = _routed_rows(delta) if self._want_routed else []
        prompt_rows = len(rows) - len(delta.token_ids)
        update.routed_rows.extend(rows[: max(prompt_rows, 0)])
        hidden_last = (
            delta.finish_reason == "stop"
            and delta.stop_token_id is not None
            and not self._include_stop
        )
        k = len(delta.top_token_ids or []) // max(len(delta.token_ids), 1)
        for i, token in enumerate(delta.token_ids):
            self.num_tokens += 1
            if self._want_logprobs:
                update.logprobs.append(_logprob_entry(delta, i, k))
            if rows:
                update.routed_rows.append(rows[prompt_rows + i])
            is_last = i == len(delta.token_ids) - 1
            if hidden_last and is_last and token == delta.stop_token_id:
                break
            piece = self._detok.push(token)
            if (ends := self._text_ends) is not None:
                ends.append((ends[-1] if ends else 0) + len(piece))
            check = self._stops.feed(piece)
            update.text += check.text
            if check.stopped:
                update.finish_reason = "stop"
                update.stopped_on_string = True
                break
        if update.finish_reason is None and delta.finish_reason is not None:
            rest = self._detok.flush()
            if self._text_ends:  # (None or empty: nothing to add to)
                self._text_ends[-1] += len(rest)  # the last tokens' held-back text
            check = self._stops.feed(rest)
            update.text += check.text + self._stops.flush()
            update.finish_reason = "stop" if check.stopped else delta.finish_reason
            update.stopped_on_string = check.stopped
        self._absorb(update)
        return update

    def count_reasoning(self, chars: int) -> None:
        """Set reasoning_tokens from the reasoning's length in the text (its end marker
        included): the tokens whose text starts within it (vLLM counts the tokens up to the
        end marker's)."""
        ends = self._text_ends
        if chars > 0 and ends is None:
            raise ValueError("count_reasoning needs an assembler made with reasoning=True")
        if chars <= 0 or not ends:
            self.reasoning_tokens = 0
        else:  # token i starts where token i - 1 ends
            self.reasoning_tokens = bisect_left(ends, chars, 0, len(ends) - 1) + 1

    def _fail(self, update: ChoiceUpdate, message: str) -> ChoiceUpdate:
        update.error = message
        update.finish_reason = "error"
        self._absorb(update)
        return update

    def _absorb(self, update: ChoiceUpdate) -> None:
        self.text += update.text
        self.logprobs.extend(update.logprobs)
        self.routed_rows.extend(update.routed_rows)
        self.finish_reason = update.finish_reason
        self.error = update.error


def _logprob_entry(delta: RequestDelta, i: int, k: int) -> TokenLogprob:
    assert delta.logprobs is not None
    top: list[tuple[int, float]] = []
    if k and delta.top_token_ids is not None and delta.top_logprobs is not None:
        ids = delta.top_token_ids[i * k : (i + 1) * k]
        lps = delta.top_logprobs[i * k : (i + 1) * k]
        top = list(zip(ids, lps, strict=True))
    return TokenLogprob(delta.token_ids[i], delta.logprobs[i], top)


def _prompt_entries(delta: RequestDelta, prompt_ids: list[int]) -> list[TokenLogprob] | None:
    """The first delta's prompt logprobs, one entry per prompt token after the first; None
    when they are missing or do not fit the prompt."""
    values = delta.prompt_logprobs
    if len(prompt_ids) <= 1:
        return []  # a one-token prompt has no token with something before it
    if values is None or len(values) != len(prompt_ids) - 1:
        return None
    ids, top = delta.prompt_top_token_ids or [], delta.prompt_top_logprobs or []
    k = len(ids) // len(values) if values else 0
    if len(top) != len(ids) or len(ids) != k * len(values):
        return None
    ranks = delta.prompt_ranks
    if ranks is not None and len(ranks) != len(values):
        return None
    return [
        TokenLogprob(
            prompt_ids[i + 1],
            value,
            list(zip(ids[i * k : (i + 1) * k], top[i * k : (i + 1) * k], strict=True)),
            ranks[i] if ranks is not None else None,
        )
        for i, value in enumerate(values)
    ]


def _routed_rows(delta: RequestDelta) -> list[list[list[int]]]:
    """The delta's flat [positions, layers, top_k] array as nested lists."""
    if delta.routed_experts is None or not delta.routed_experts_shape:
        return []
    positions, layers, top_k = delta.routed_experts_shape
    flat = delta.routed_experts
    return [
        [flat[(p * layers + m) * top_k : (p * layers + m + 1) * top_k] for m in range(layers)]
        for p in range(positions)
    ]
