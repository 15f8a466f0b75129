"""The worker's persistent batch: what it remembers about each request between steps.

Each request holds a row (a slot in fixed-size host arrays) for as long as it lives in the batch;
the sampler's per-row state uses the same row index. Freed rows are reused, lowest first, so the
live rows stay dense near 0 without ever moving a request (moving would mean moving its sampling
state too).

Per row: every known token id (prompt, then sampled tokens appended by the worker itself, so a
StepPlan never resends history), the prompt length, how many tokens have KV in the cache
(`num_computed_tokens`), and one append-only block table per KV cache group. The arrays are
numpy so a step's index tensors are built with vectorized gathers, not per-token Python.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import numpy as np

from shared.protocol import CachedRequestData, NewRequestData, SamplingParams, StepPlan


class PlanError(ValueError):
    """A StepPlan that does not fit the worker's batch (unknown request, tokens or blocks out of
    range). The step is not run; the service reports it as StepResult.error."""


@dataclass
class BatchChanges:
    """Rows that left and rows that joined in one `apply`, for the sampler's per-row state."""

    removed_rows: list[int] = field(default_factory=list)
    added: list[tuple[int, NewRequestData]] = field(default_factory=list)


class InputBatch:
    def __init__(
        self,
        max_num_reqs: int,
        max_model_len: int,
        block_size: int,
        num_kv_groups: int = 1,
        num_cache_blocks: int | list[int] = 0,
    ) -> None:
        # Block ids of each group must be below its pool's size (0 = unchecked); an int bounds
        # every group alike, a list each group (a hybrid's state group indexes the state pool).
        if isinstance(num_cache_blocks, int):
            num_cache_blocks = [num_cache_blocks] * num_kv_groups
        if len(num_cache_blocks) != num_kv_groups:
            raise ValueError(f"{len(num_cache_blocks)} pool sizes for {num_kv_groups} groups")
        self.num_cache_blocks = num_cache_blocks
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.num_kv_groups = num_kv_groups
        self.max_blocks_per_req = -(-max_model_len // block_size)
        # int32 like the wire format: at a 128k context and 256 rows this is 128 MiB, not 256.
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int32)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.block_tables = np.zeros(
            (num_kv_groups, max_num_reqs, self.max_blocks_per_req), dtype=np.int64
        )
        self.num_blocks = np.zeros((num_kv_groups, max_num_reqs), dtype=np.int64)
        self.sampling: list[SamplingParams | None] = [None] * max_num_reqs
        self.req_rows: dict[str, int] = {}
        self.row_req: list[str | None] = [None] * max_num_reqs
        self._free_rows = list(range(max_num_reqs))  # a heap: reuse the lowest free row

    def __len__(self) -> int:
        return len(self.req_rows)

    @property
    def num_reqs(self) -> int:
        return len(self.req_rows)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.req_rows

    def apply(self, plan: StepPlan) -> BatchChanges:
        """Apply a plan's diff: drop finished and preempted, add new, extend cached.

        Finished/preempted ids the batch does not hold are ignored (a repeated finish is
        harmless). A new request already present replaces the old entry: the scheduler's view
        of it is authoritative.
        """
        changes = BatchChanges()
        for request_id in (*plan.finished_request_ids, *plan.preempted_request_ids):
            row = self.remove(request_id)
            if row is not None:
                changes.removed_rows.append(row)
        for new in plan.new_requests:
            if new.request_id in self.req_rows:
                changes.removed_rows.append(self.remove(new.request_id))  # type: ignore[arg-type]
            changes.added.append((self.add(new), new))
        for cached in plan.cached_requests:
            # A request verifying the worker's own drafts keeps the worker's computed count:
            # the plan's counts its in-flight lookahead slots as accepted (StepPlan.spec_lookahead).
            self.update(cached, keep_computed=cached.request_id in plan.spec_lookahead)
        return changes

    def add(self, new: NewRequestData) -> int:
        tokens = len(new.token_ids)
        if tokens > self.max_model_len:
            raise PlanError(
                f"{new.request_id}: {tokens} tokens exceed max_model_len={self.max_model_len}"
            )
        if not new.num_prompt_tokens <= tokens or not new.num_computed_tokens <= tokens:
            raise PlanError(
                f"{new.request_id}: num_prompt_tokens={new.num_prompt_tokens}, "
                f"num_computed_tokens={new.num_computed_tokens} but {tokens} token ids"
            )
        self._check_groups(new.request_id, new.block_ids)
        if not self._free_rows:
            raise PlanError(f"{new.request_id}: batch full ({self.max_num_reqs} requests)")
        row = heapq.heappop(self._free_rows)
        self.req_rows[new.request_id] = row
        self.row_req[row] = new.request_id
        self.token_ids[row, :tokens] = new.token_ids
        self.num_tokens[row] = tokens
        self.num_prompt_tokens[row] = new.num_prompt_tokens
        self.num_computed_tokens[row] = new.num_computed_tokens
        self.num_blocks[:, row] = 0
        self.sampling[row] = new.sampling
        try:
            self._append_blocks(row, new.request_id, new.block_ids)
        except PlanError:
            self.remove(new.request_id)
            raise
        return row

    def update(self, cached: CachedRequestData, keep_computed: bool = False) -> None:
        row = self.row_of(cached.request_id)
        self._check_groups(cached.request_id, cached.new_block_ids)
        if keep_computed:
            self._append_blocks(row, cached.request_id, cached.new_block_ids)
            return
        if cached.num_computed_tokens > self.num_tokens[row]:
            raise PlanError(
                f"{cached.request_id}: num_computed_tokens={cached.num_computed_tokens} but only "
                f"{self.num_tokens[row]} tokens known"
            )
        self._append_blocks(row, cached.request_id, cached.new_block_ids)
        self.num_computed_tokens[row] = cached.num_computed_tokens

    def remove(self, request_id: str) -> int | None:
        row = self.req_rows.pop(request_id, None)
        if row is None:
            return None
        self.row_req[row] = None
        self.sampling[row] = None
        heapq.heappush(self._free_rows, row)
        return row

    def row_of(self, request_id: str) -> int:
        row = self.req_rows.get(request_id)
        if row is None:
            raise PlanError(f"{request_id}: not in the worker's batch")
        return row

    def append_sampled(self, rows: np.ndarray, token_ids: np.ndarray) -> None:
        """Append one sampled token to each row (the next step computes its KV).

        A row already holding max_model_len tokens keeps none: its token is still returned to
        the scheduler, which finishes the request ("length"); scheduling it again would then
        be a PlanError (more tokens scheduled than known).
        """
        ends = self.num_tokens[rows]
        room = ends < self.max_model_len
        rows, ends = rows[room], ends[room]
        self.token_ids[rows, ends] = np.asarray(token_ids)[room]
        self.num_tokens[rows] = ends + 1

    def tokens_of(self, request_id: str) -> list[int]:
        row = self.row_of(request_id)
        return self.token_ids[row, : self.num_tokens[row]].tolist()  # type: ignore[no-any-return]

    def _check_groups(self, request_id: str, block_ids: list[list[int]]) -> None:
        if len(block_ids) != self.num_kv_groups:
            raise PlanError(
                f"{request_id}: {len(block_ids)} block-id lists for {self.num_kv_groups} "
                "KV cache group(s)"
            )

    def _append_blocks(self, row: int, request_id: str, block_ids: list[list[int]]) -> None:
        # Block tables are append-only while a request lives: the scheduler only ever adds
        # blocks to a running request (freeing happens by finishing or preempting it).
        for group, ids in enumerate(block_ids):
            if not ids:
                continue
            start = int(self.num_blocks[group, row])
            end = start + len(ids)
            if end > self.max_blocks_per_req:
                raise PlanError(
                    f"{request_id}: {end} blocks exceed {self.max_blocks_per_req} per request"
                )
            bound = self.num_cache_blocks[group]
            if bound and not 0 <= min(ids) <= max(ids) < bound:
                raise PlanError(
                    f"{request_id}: block ids {ids} of group {group} outside [0, {bound})"
                )
            self.block_tables[group, row, start:end] = ids
            self.num_blocks[group, row] = end
