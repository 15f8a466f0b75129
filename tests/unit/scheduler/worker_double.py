"""A stand-in for the worker, for scheduler tests. It is the scheduler's collaborator, not a
model: it "samples" `token_at(request_id, position)`, a pure function, so every request's whole
output is known in advance whatever preemption, chunking or restarts happen on the way.

It also checks the plan protocol as the real worker relies on it, failing the test on any
violation: removals refer to requests it holds, new requests are unknown to it, cached requests
carry its own num_computed_tokens, no block is written by two requests in one step, a block
written this step is in another request's table only as a full block of that request's
computed prefix (a prefix hit on it), and every prefix-hit block really holds that request's
tokens (its "KV" records which token was written into each slot).

Like the real worker (attention.py writes the K/V of the whole flat batch before any attention
reads it), the double writes every scheduled token first and reads prefix-hit blocks after: a
request may hit a block that another request of the same step fills (n siblings admitted
together share their prompt that way; the scheduler registers blocks at allocation).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from shared.protocol import SampledTokens, StepPlan, StepResult

VOCAB = 1000
FIRST_ID = 10  # ids below are kept free for eos/stop tokens chosen by tests


def token_at(request_id: str, position: int) -> int:
    digest = hashlib.sha256(f"{request_id}:{position}".encode()).digest()
    return FIRST_ID + int.from_bytes(digest[:4], "little") % (VOCAB - FIRST_ID)


@dataclass
class HeldRequest:
    tokens: list[int]
    block_ids: list[int]
    num_computed: int


@dataclass
class WorkerDouble:
    block_size: int
    incarnation: str = "w0"
    held: dict[str, HeldRequest] = field(default_factory=dict)
    kv: dict[int, list[int | None]] = field(default_factory=dict)  # block id -> token per slot
    overrides: dict[tuple[str, int], list[int]] = field(default_factory=dict)
    steps: int = 0

    def run(self, plan: StepPlan) -> StepResult:
        self.steps += 1
        for rid in [*plan.finished_request_ids, *plan.preempted_request_ids]:
            assert rid in self.held, f"removal of {rid}, which the worker does not hold"
            del self.held[rid]
        for new in plan.new_requests:
            assert new.request_id not in self.held, f"{new.request_id} sent as new twice"
            assert len(new.block_ids) == 1
            held = HeldRequest(list(new.token_ids), list(new.block_ids[0]), new.num_computed_tokens)
            self.held[new.request_id] = held
        for cached in plan.cached_requests:
            held = self.held[cached.request_id]
            assert cached.num_computed_tokens == held.num_computed, cached.request_id
            held.block_ids.extend(cached.new_block_ids[0])
        sampled: list[SampledTokens] = []
        written_by: dict[int, str] = {}
        for rid, n in plan.num_scheduled_tokens.items():
            held = self.held[rid]
            start, end = held.num_computed, held.num_computed + n
            assert end <= len(held.tokens), f"{rid} scheduled past its known tokens"
            assert len(held.block_ids) * self.block_size >= end, f"{rid} lacks slots"
            for pos in range(start, end):
                block_id = held.block_ids[pos // self.block_size]
                assert written_by.setdefault(block_id, rid) == rid, f"block {block_id} shared"
                slots = self.kv.setdefault(block_id, [None] * self.block_size)
                slots[pos % self.block_size] = held.tokens[pos]
            held.num_computed = end
            if end == len(held.tokens):
                ids = self.overrides.get((rid, end), [token_at(rid, end)])
                held.tokens.extend(ids)
                sampled.append(SampledTokens(request_id=rid, token_ids=ids))
        hit_now = {new.request_id: new.num_computed_tokens for new in plan.new_requests}
        for block_id, rid in written_by.items():
            for other, held in self.held.items():
                if other == rid or block_id not in held.block_ids:
                    continue
                index = held.block_ids.index(block_id)
                assert (index + 1) * self.block_size <= hit_now.get(other, 0), (
                    f"block {block_id} written by {rid} is also in {other}'s table, "
                    "and not as a prefix hit of a request admitted in this step"
                )
        for rid, num_hit in hit_now.items():  # read after the step's writes, as attention does
            self._check_prefix_content(rid, self.held[rid], num_hit)
        return StepResult(
            step_id=plan.step_id,
            worker_id="double",
            worker_incarnation=self.incarnation,
            sampled=sampled,
        )

    def _check_prefix_content(self, rid: str, held: HeldRequest, num_hit: int) -> None:
        for pos in range(num_hit):
            block_id = held.block_ids[pos // self.block_size]
            slots = self.kv.get(block_id)
            assert slots is not None and slots[pos % self.block_size] == held.tokens[pos], (
                f"{rid}: prefix-hit block {block_id} does not hold token {pos}"
            )
