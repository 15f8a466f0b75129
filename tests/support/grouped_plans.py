"""PlanDriver for models with several KV cache groups (sliding windows) and routed experts.

Per request and group it keeps the scheduler-side block list the way shared/kv/groups.py fixes
it: one entry per block of the request's tokens; in a sliding-window group, blocks wholly out of
the window of every future query are given back to the pool at once (at the FRONT of the free
list, so another request reuses them next) and their entries become the null block 0, which is
never allocated. The worker keeps the stale ids in its append-only table, so a worker that read
outside the window would read another request's K/V and the outputs would differ.
"""

from __future__ import annotations

from services.worker.runner.model_runner import ModelRunner
from shared.kv.groups import KVGroupSpec
from shared.protocol import SamplingParams, StepPlan
from tests.support.plans import DriverRequest, PlanDriver

NULL_BLOCK = 0


class GroupedPlanDriver(PlanDriver):
    def __init__(self, runner: ModelRunner, **kwargs: object) -> None:
        if kwargs.get("prefix_caching"):
            raise ValueError("GroupedPlanDriver does not model prefix caching")
        super().__init__(runner, **kwargs)  # type: ignore[arg-type]
        self.groups: list[KVGroupSpec] = runner.kv_groups
        self.free_blocks.remove(NULL_BLOCK)
        self.tables: dict[str, list[list[int]]] = {}  # request -> per group, nulls included
        self.new: dict[str, list[list[int]]] = {}
        self.routed_experts: set[str] = set()
        self.peak_blocks: dict[str, int] = {}  # live (non-null) blocks held, at most

    def add(
        self,
        request_id: str,
        prompt: list[int],
        sampling: SamplingParams,
        routed_experts: bool = False,
    ) -> DriverRequest:
        if routed_experts:
            self.routed_experts.add(request_id)
        return super().add(request_id, prompt, sampling)

    def _allocate(self, req: DriverRequest, upto_tokens: int) -> None:
        tables = self.tables.setdefault(req.request_id, [[] for _ in self.groups])
        new = self.new.setdefault(req.request_id, [[] for _ in self.groups])
        needed = -(-upto_tokens // self.block_size)
        for group, table, fresh in zip(self.groups, tables, new, strict=True):
            while len(table) < needed:
                block = self.free_blocks.pop(0)
                table.append(block)
                fresh.append(block)
            if group.sliding_window is not None:
                # The next query is at num_computed; it (and every later one) needs keys
                # > num_computed - window only.
                first_needed = max(0, req.num_computed - group.sliding_window + 1)
                for i in range(first_needed // self.block_size):
                    if table[i] != NULL_BLOCK:
                        self.free_blocks.insert(0, table[i])
                        table[i] = NULL_BLOCK
        held = sum(b != NULL_BLOCK for table in tables for b in table)
        self.peak_blocks[req.request_id] = max(self.peak_blocks.get(req.request_id, 0), held)

    def _release(self, req: DriverRequest) -> None:
        for table in self.tables.pop(req.request_id, []):
            self.free_blocks.extend(b for b in table if b != NULL_BLOCK)
        self.new.pop(req.request_id, None)

    def _block_ids(self, req: DriverRequest) -> list[list[int]]:
        self.new[req.request_id] = [[] for _ in self.groups]
        return [list(t) for t in self.tables[req.request_id]]

    def _new_block_ids(self, req: DriverRequest) -> list[list[int]]:
        fresh = self.new[req.request_id]
        self.new[req.request_id] = [[] for _ in self.groups]
        return fresh

    def build_plan(self) -> StepPlan:
        plan = super().build_plan()
        for new in plan.new_requests:
            new.return_routed_experts = new.request_id in self.routed_experts
        return plan
