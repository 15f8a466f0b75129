"""A worker stand-in for several KV cache groups (full attention, sliding windows, state).

Like the real worker it keeps one block table per group and request, built only from plan
diffs (a block the scheduler dropped out of a window stays in this table: the worker is never
told), writes every scheduled token's "KV" (the token id) into each group's blocks, and only
then reads, for every computed position, the positions its layers attend to: all earlier ones
for full attention, the last `window` ones for a sliding window. A read that lands on the null
block, or on a slot holding another token (a block freed too early and reused), fails the test.

A state group (shared/kv/groups.py's entry rule) keeps, per block, the "state" after the
tokens it stands for (the token tuple itself): every request's state is read from entry
ceil(n / block_size) - 1 before anything of the step is written (a state written in the same
step cannot be read: the real worker reads states before computing), then boundary states and
the final state are written. A read of the null block or of another prefix's state fails.

A ring group (`Ring(R)`, shared/kv/groups.py's slot rule) keeps position p in entry
(p // block_size) % n, n = ceil(R / block_size); its table may never hold more than n entries.
Before the step's writes every request reads the ring positions the step's first query needs
from the ring (the last R - 1 before it: a multi-token step overwrites older slots, so a real
ring kernel reads them first, and takes the step's own K/V from its inputs); after the writes
the ring must hold each of the last min(n * block_size, computed) positions.

It samples `token_at(request_id, position)` and, for requests asking for routed experts,
returns `row_at(position)` per computed position: with `hold_rows`, rows of chunks that sample
nothing are kept and sent with the next sampled token; otherwise each such chunk sends them in
a SampledTokens without tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.kv.groups import LayerCache, Ring
from shared.protocol import SampledTokens, StepPlan, StepResult
from tests.unit.scheduler.worker_double import token_at

MOE_LAYERS, TOP_K = 2, 3


def row_at(position: int) -> list[int]:
    """The routed-experts row [MOE_LAYERS][TOP_K] the stand-in reports for a position."""
    return [position * 100 + j for j in range(MOE_LAYERS * TOP_K)]


@dataclass
class Held:
    tokens: list[int]
    tables: list[list[int]]  # one per group
    num_computed: int
    routed: bool
    rows: list[int] = field(default_factory=list)  # held routed rows (hold_rows mode)
    rows_from: int = 0


@dataclass
class GroupWorker:
    block_size: int
    windows: list[LayerCache]  # per group: None = full, int = window, "state", Ring(R)
    hold_rows: bool = False
    held: dict[str, Held] = field(default_factory=dict)
    kv: dict[tuple[int, int], list[int | None]] = field(default_factory=dict)
    states: dict[tuple[int, int], tuple[int, ...]] = field(default_factory=dict)
    positions_read: int = 0
    states_read: int = 0
    ring_positions_read: int = 0

    def run(self, plan: StepPlan) -> StepResult:
        for rid in [*plan.finished_request_ids, *plan.preempted_request_ids]:
            del self.held[rid]
        for new in plan.new_requests:
            assert len(new.block_ids) == len(self.windows)
            self.held[new.request_id] = Held(
                list(new.token_ids),
                [list(ids) for ids in new.block_ids],
                new.num_computed_tokens,
                new.return_routed_experts,
                rows_from=new.num_computed_tokens,
            )
        for cached in plan.cached_requests:
            held = self.held[cached.request_id]
            assert cached.num_computed_tokens == held.num_computed
            for table, ids in zip(held.tables, cached.new_block_ids, strict=True):
                table.extend(ids)
        for rid in [*(n.request_id for n in plan.new_requests), *plan.num_scheduled_tokens]:
            self._check_ring_tables(rid)
        spans = {
            rid: (self.held[rid].num_computed, n) for rid, n in plan.num_scheduled_tokens.items()
        }
        for rid, (start, _) in spans.items():
            self._read_states(rid, start)
            self._read_rings(rid, start)
        for rid, (start, n) in spans.items():
            self._write(rid, start, start + n)
        sampled = [self._finish(rid, start, start + n) for rid, (start, n) in spans.items()]
        return StepResult(
            step_id=plan.step_id,
            worker_id="groups",
            sampled=[s for s in sampled if s is not None],
        )

    def _slot(self, group: int, held: Held, pos: int) -> list[int | None]:
        table = held.tables[group]
        assert pos // self.block_size < len(table), f"no slot for position {pos}"
        block_id = table[pos // self.block_size]
        assert block_id != 0, f"group {group}: position {pos} maps to the null block"
        return self.kv.setdefault((group, block_id), [None] * self.block_size)

    def _state_entry(self, group: int, held: Held, num_tokens: int) -> int:
        table = held.tables[group]
        index = -(-num_tokens // self.block_size) - 1
        assert index < len(table), f"group {group}: no state entry for {num_tokens} tokens"
        assert table[index] != 0, f"group {group}: state of {num_tokens} tokens in the null block"
        return table[index]

    def _ring_blocks(self, window: Ring) -> int:
        return -(-window.ring_size // self.block_size)

    def _check_ring_tables(self, rid: str) -> None:
        held = self.held[rid]
        for group, window in enumerate(self.windows):
            if isinstance(window, Ring):
                table = held.tables[group]
                assert len(table) <= self._ring_blocks(window), f"{rid} g{group}: ring grew"
                assert 0 not in table, f"{rid} g{group}: a null block in a ring"

    def _ring_slot(self, group: int, held: Held, pos: int) -> list[int | None]:
        window = self.windows[group]
        assert isinstance(window, Ring)
        table = held.tables[group]
        entry = (pos // self.block_size) % self._ring_blocks(window)
        assert entry < len(table), f"group {group}: no ring entry for position {pos}"
        return self.kv.setdefault((group, table[entry]), [None] * self.block_size)

    def _read_rings(self, rid: str, start: int) -> None:
        """The positions before the step that its first query attends to, read before the
        step overwrites any slot."""
        held = self.held[rid]
        for group, window in enumerate(self.windows):
            if not isinstance(window, Ring):
                continue
            for pos in range(max(0, start - window.ring_size + 1), start):
                got = self._ring_slot(group, held, pos)[pos % self.block_size]
                assert got == held.tokens[pos], f"{rid} g{group}: stale ring slot at {pos}"
                self.ring_positions_read += 1

    def _read_states(self, rid: str, start: int) -> None:
        held = self.held[rid]
        for group, window in enumerate(self.windows):
            if window != "state" or start == 0:
                continue
            got = self.states.get((group, self._state_entry(group, held, start)))
            assert got == tuple(held.tokens[:start]), f"{rid} g{group}: wrong state at {start}"
            self.states_read += 1

    def _write(self, rid: str, start: int, end: int) -> None:
        held = self.held[rid]
        assert end <= len(held.tokens)
        for group, window in enumerate(self.windows):
            if window == "state":
                bs = self.block_size
                for n in [*range((start // bs + 1) * bs, end, bs), end]:
                    entry = self._state_entry(group, held, n)
                    self.states[(group, entry)] = tuple(held.tokens[:n])
                continue
            if isinstance(window, Ring):
                for pos in range(start, end):
                    self._ring_slot(group, held, pos)[pos % self.block_size] = held.tokens[pos]
                continue
            for pos in range(start, end):
                self._slot(group, held, pos)[pos % self.block_size] = held.tokens[pos]

    def _finish(self, rid: str, start: int, end: int) -> SampledTokens | None:
        held = self.held[rid]
        for group, window in enumerate(self.windows):  # reads after every write of the step
            if isinstance(window, str):
                continue  # states were read before the step's writes
            if isinstance(window, Ring):  # the ring holds the latest positions, each in place
                span = self._ring_blocks(window) * self.block_size
                for pos in range(max(0, end - span), end):
                    got = self._ring_slot(group, held, pos)[pos % self.block_size]
                    assert got == held.tokens[pos], f"{rid} g{group}: ring lost {pos}"
                continue
            for q in range(start, end):
                first = 0 if window is None else max(0, q - window + 1)
                for pos in range(first, q + 1):
                    got = self._slot(group, held, pos)[pos % self.block_size]
                    assert got == held.tokens[pos], f"{rid} g{group}: stale KV at {pos}"
                    self.positions_read += 1
        held.num_computed = end
        rows: list[int] = []
        if held.routed:
            held.rows += [v for pos in range(start, end) for v in row_at(pos)]
            if end == len(held.tokens) or not self.hold_rows:
                rows, held.rows = held.rows, []
        if end < len(held.tokens):
            if not rows:
                return None
            return _sampled(rid, [], rows)
        token = token_at(rid, end)
        held.tokens.append(token)
        return _sampled(rid, [token], rows)


def _sampled(rid: str, tokens: list[int], rows: list[int]) -> SampledTokens:
    if not rows:
        return SampledTokens(request_id=rid, token_ids=tokens)
    width = MOE_LAYERS * TOP_K
    return SampledTokens(
        request_id=rid,
        token_ids=tokens,
        routed_experts=rows,
        routed_experts_shape=[len(rows) // width, MOE_LAYERS, TOP_K],
    )
