"""Routed experts of one request, turned from the worker's per-step rows into reply rows.

Reply layout (fixed by the gateway, services/gateway/stream/reply_dedup.py): the delta with
`start_index == 0` carries first the prompt rows, positions `routed_experts_prompt_start ..
prompt_len - 1`, then one row per token; every later delta carries one row per token. A row is
[moe_layers][top_k] expert ids, flattened row-major.

Which position is a token's row: output token i was sampled by the forward of position
`prompt_len - 1 + i` (its input is the token before it), and that forward's routing is its row.
So the first output token repeats the last prompt position's row, every position the engine
computed is returned, and no token ever needs an extra forward (the last sampled token is
never an input).

Worker side (SampledTokens.routed_experts, shape [positions, moe_layers, top_k]): rows of
consecutive positions ending with the last position the step computed (`planned_end` is one
past it).
Prompt rows of a chunk that samples nothing may come in their own SampledTokens without tokens
or be held by the worker and sent with the next sampled token's rows; both work,
because rows are placed by position. A recompute (preemption, failed step) sends rows again for
the same positions, which overwrite the earlier ones, so the reply never depends on the path.
With speculative decoding a step's rows also cover rejected drafts; tokens are still placed by
position (accepted token j of a step starting at c was sampled by position c + j).

Such a request never takes a prefix-cache hit (KVCacheManager.get_computed_blocks): a cached
position is never computed, so it would have no row.
"""

from __future__ import annotations

from shared.protocol import RequestDelta, SampledTokens, StepPlan, SubmitRequest


def prompt_start_error(msg: SubmitRequest) -> str | None:
    """The scheduler's own boundary check (the gateway checked it first): the interval is
    closed, `start == prompt_len` asks for no prompt rows. Reject, never clamp."""
    if not msg.return_routed_experts:
        return None
    start, prompt_len = msg.routed_experts_prompt_start, len(msg.prompt_token_ids)
    if 0 <= start <= prompt_len:
        return None
    return f"routed_experts_prompt_start {start} is outside [0, {prompt_len}]"


def planned_end(plan: StepPlan, request_id: str) -> int:
    """One past the last position `plan` computes for the request: read from the plan, not
    from the request, whose counter may already be elsewhere when the result is applied (the
    next step planned ahead of this result, or rejected drafts rolled back)."""
    num_scheduled = plan.num_scheduled_tokens[request_id]
    for entry in (*plan.new_requests, *plan.cached_requests):
        if entry.request_id == request_id:
            return entry.num_computed_tokens + num_scheduled
    raise ValueError(f"{request_id} is scheduled in step {plan.step_id} but not listed")


class RoutedExpertsRecord:
    """Collects the prompt rows until they are sent; maps sampled tokens to their rows."""

    __slots__ = (
        "_prompt_rows",
        "_shape",
        "_step",
        "num_prompt_tokens",
        "prompt_sent",
        "prompt_start",
    )

    def __init__(self, prompt_start: int, num_prompt_tokens: int) -> None:
        self.prompt_start = prompt_start
        self.num_prompt_tokens = num_prompt_tokens
        self.prompt_sent = False
        # Row of each prompt position from `prompt_start` on, None until computed.
        self._prompt_rows: list[list[int] | None] = [None] * (num_prompt_tokens - prompt_start)
        self._shape: tuple[int, int] = (0, 0)  # (moe_layers, top_k) of the latest rows
        # The latest step's rows: (flat rows, first position, end position, row width).
        self._step: tuple[list[int], int, int, int] | None = None

    def record(self, sampled: SampledTokens, end: int) -> None:
        """Take a step's rows, which end at position `end` (exclusive; the request's computed
        tokens as planned, before any rollback of rejected drafts). Keeps the prompt rows among
        them, and all of them for the tokens `attach` is about to place."""
        self._step = None
        rows, shape = sampled.routed_experts, sampled.routed_experts_shape
        if rows is None or shape is None or len(shape) != 3:
            return
        positions, layers, top_k = shape
        width = layers * top_k
        if width <= 0 or positions * width != len(rows) or not 0 <= positions <= end:
            return
        self._shape = (layers, top_k)
        first = end - positions
        self._step = (rows, first, end, width)
        if not self.prompt_sent:
            for pos in range(max(first, self.prompt_start), min(end, self.num_prompt_tokens)):
                offset = (pos - first) * width
                self._prompt_rows[pos - self.prompt_start] = rows[offset : offset + width]

    def attach(self, delta: RequestDelta) -> None:
        """Give `delta` the rows of its tokens (from the step just recorded), preceded by the
        prompt rows when it is the first delta. A delta whose rows are incomplete (the worker
        sent none for a needed position) gets none rather than misaligned ones."""
        step, self._step = self._step, None
        if step is None:
            return
        rows, first, end, width = step
        flat: list[int] = []
        with_prompt = delta.start_index == 0 and not self.prompt_sent
        if with_prompt:
            for row in self._prompt_rows:
                if row is None:
                    return
                flat += row
        for i in range(delta.start_index, delta.start_index + len(delta.token_ids)):
            pos = self.num_prompt_tokens - 1 + i
            if not first <= pos < end:
                return
            offset = (pos - first) * width
            flat += rows[offset : offset + width]
        delta.routed_experts = flat
        delta.routed_experts_shape = [len(flat) // width, *self._shape]
        if with_prompt:
            self.prompt_sent = True
            self._prompt_rows = []  # delivered once; later deltas carry token rows only
