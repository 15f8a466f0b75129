"""The scheduler core: turns queued requests into StepPlans and StepResults into token deltas.

Policy (vLLM v1): every step, running requests first, in admission order, each getting its
remaining tokens (1 when decoding, its next chunk when prefilling) within the step's token
budget; then waiting requests from the head of the waiting queue while the budget and
`max_num_seqs` allow, a prompt longer than the remaining budget being split across steps
(chunked prefill); with `long_prefill_token_threshold` no request gets more than that many
tokens in one step, so a long prefill leaves room for others in each of its steps. When a
running request cannot get a block, a running request is preempted by recompute: its blocks
are freed and it goes back to the waiting queue, to be re-admitted later as a new request
carrying prompt + outputs so far. No waiting request is admitted in a step that preempted, so
a victim is never re-admitted in the plan that drops it.

The scheduling policy (`SchedulerConfig.scheduling_policy`, waiting_queue.py) picks the order:
"fcfs" queues by arrival, a request going back goes to the FRONT, and the victim is the last
admitted; "priority" queues by (priority, arrival) on every insert, and the victim is the
least urgent running request, largest (priority, arrival), even one the running pass already
scheduled this step (its part of the plan is taken back). As in vLLM, a waiting request never
preempts a running one, whatever its priority.

Step protocol: `schedule()` advances `num_computed_tokens` by what it schedules; the caller
runs the plan and then calls `update_from_output(plan, result)` (or `step_failed`) before the
next `schedule()`. Blocks are registered in the prefix cache when they are allocated for the
step that fills them (KVCacheManager explains why that is sound), so n siblings admitted in one
step compute their shared prompt once; a failed step unregisters the blocks it was to write.
Plans are diffs: the scheduler tracks which requests the worker holds, so finished/preempted
ids are sent only for requests the worker knows. The worker must apply `finished_request_ids`
and `preempted_request_ids` before adding `new_requests`.
"""

from __future__ import annotations

import itertools
import logging
from typing import TYPE_CHECKING

from services.scheduler.config import SchedulerConfig
from services.scheduler.kv.block_pool import KVCacheBlock
from services.scheduler.kv.kv_cache_manager import KVCacheManager
from services.scheduler.kv.single_type_manager import FullAttentionManager
from services.scheduler.offload.connector import LoadOutcome, OffloadConnector
from services.scheduler.request import Request, RequestStatus
from services.scheduler.resume import resume_error
from services.scheduler.routed_experts import planned_end, prompt_start_error
from services.scheduler.scheduler_output import SchedulerOutput, SchedulerSnapshot
from services.scheduler.spec import SpecDecoding
from services.scheduler.stop import check_stop
from services.scheduler.structured_output import StructuredOutputManager
from services.scheduler.submit_check import token_ids_error
from services.scheduler.waiting_queue import WaitingQueue, priority_key, waiting_queue
from shared.protocol import (
    CachedRequestData,
    FinishReason,
    NewRequestData,
    ProgressCheckpoint,
    RequestDelta,
    SampledTokens,
    StepPlan,
    StepResult,
    SubmitRequest,
)
from shared.protocol.trusted import TrustedBuilder

if TYPE_CHECKING:
    from xgrammar import CompiledGrammar

log = logging.getLogger(__name__)

RUNNING = RequestStatus.RUNNING
_new_request_data = TrustedBuilder(NewRequestData)
_cached_request_data = TrustedBuilder(CachedRequestData)
_step_plan = TrustedBuilder(StepPlan)
_request_delta = TrustedBuilder(RequestDelta)


class Scheduler:
    def __init__(self, config: SchedulerConfig, scheduler_id: str) -> None:
        self.config = config
        self.scheduler_id = scheduler_id
        self.worker_incarnation = ""  # stamped on every plan; set by reset_worker_state
        self.kv = KVCacheManager(config)
        self.requests: dict[str, Request] = {}  # every live (waiting or running) request
        self.waiting: WaitingQueue = waiting_queue(config.scheduling_policy)
        self.running: list[Request] = []  # admission order
        self._arrivals = itertools.count()  # intake order: ties of arrival_time (priority)
        self.step_id = 0
        # Plans handed out and not yet updated. A result for any other step (one that ran on
        # a worker since reset, or a duplicate) is ignored: its requests have moved on.
        self._in_flight: set[int] = set()
        # Per in-flight step: the requests it samples (the others compute a prefill chunk).
        self._sampling_steps: dict[int, list[str]] = {}
        # Per in-flight step: the blocks it registered in the prefix cache at allocation, whose
        # KV it is yet to write. Invariant: a hash in the prefix cache names a block whose KV is
        # written, or will be by a step still in flight; `step_failed` unregisters that step's
        # blocks, and `reset_worker_state` drops the whole cache.
        self._unwritten: dict[int, list[KVCacheBlock]] = {}
        self._eos = frozenset(config.eos_token_ids)
        # One request's tokens per step at most (a long prefill takes several steps).
        self._prefill_cap = config.long_prefill_token_threshold or config.max_num_batched_tokens
        # Diff state towards the worker: which requests it holds, and removals not yet sent.
        self._worker_known: set[str] = set()
        self._finished_for_worker: list[str] = []
        self._preempted_for_worker: list[str] = []
        self.num_preemptions = 0
        self.num_finished = 0
        self.num_aborted = 0
        self.num_step_failures = 0
        self.structured = StructuredOutputManager(config.reasoning)
        # KV offload tier (services/scheduler/offload): set by the service when a kvstore is
        # configured; None = no external loads or stores, exactly the behaviour without it.
        self.offload: OffloadConnector | None = None
        # Drafts on the worker need plain full-attention groups: a sliding window drops and a
        # ring reuses blocks by num_computed_tokens, which runs ahead of the worker's count.
        full_attention = all(
            isinstance(m, FullAttentionManager) for m in self.kv.coordinator.managers
        )
        self.spec = SpecDecoding(
            config.num_spec_tokens,
            config.max_model_len,
            config.spec_drafts_on_worker and full_attention,
        )
        # Prefill role (services/scheduler/pd): requests compute their (truncated) prompt and
        # sample nothing; the service hands them to a decode scheduler (`release_prefilled`).
        self.prefill_only = False

    # ----------------------------------------------------------------- requests in and out

    def add_request(
        self,
        msg: SubmitRequest,
        grammar: CompiledGrammar | None = None,
        checkpoint: ProgressCheckpoint | None = None,
    ) -> RequestDelta | None:
        """Queue a request. Returns None when accepted (or already known: redelivery of the
        same request id is idempotent), or a finished "error" delta explaining the rejection.
        A structured-output request comes with its compiled grammar, loaded by the caller.
        `checkpoint`: the progress of a request taken over after a fault; when it fits
        (resume.py) the request continues after its tokens, else it starts from the prompt
        (`get_request(...).num_output_tokens` tells which)."""
        if msg.request_id in self.requests:
            return None
        if error := self._admission_error(msg):  # the request's own fault: a 400
            delta = _final_delta(msg.request_id, 0, "error", error=error)
            delta.error_type = "invalid_request_error"
            return delta
        if msg.grammar is not None and grammar is None:
            error = "the request's structured-output grammar is not loaded"
            return _final_delta(msg.request_id, 0, "error", error=error)
        request = Request.from_submit(msg, self.config.block_size, next(self._arrivals))
        if grammar is not None:
            self.structured.add(request.request_id, grammar)
        if checkpoint is not None:
            self._resume(request, msg, checkpoint, grammar)
        self.requests[request.request_id] = request
        self.waiting.append(request)
        if self.offload is not None:
            self.offload.cost.batch_running = bool(self.running)
            self.offload.on_request_added(request)
        return None

    def _resume(
        self,
        request: Request,
        msg: SubmitRequest,
        checkpoint: ProgressCheckpoint,
        grammar: CompiledGrammar | None,
    ) -> None:
        """Give the fresh `request` the checkpoint's tokens as outputs already generated (and
        delivered: its first delta went out then), its grammar matcher replayed over them;
        leave it from-the-prompt when the checkpoint does not fit. Stop checks run as if the
        tokens were sampled, so a checkpoint that would end the request (a running request's
        never does) is void."""
        tokens = checkpoint.output_token_ids
        reason = resume_error(checkpoint, msg, self.config.vocab_size, self.config.max_model_len)
        if reason is None:
            trial = Request.from_submit(msg, self.config.block_size)
            for token in tokens:
                trial.append_output_token(token)
                if check_stop(trial, self._eos, self.config.max_model_len) is not None:
                    reason = "its tokens finish the request"
                    break
        if reason is None and grammar is not None:
            replay = self.structured.accept(request.request_id, request.all_token_ids, tokens)
            if replay is None or replay.num_tokens != len(tokens) or replay.finish_reason:
                reason = "the grammar does not accept its tokens"
                self.structured.add(request.request_id, grammar)  # a fresh matcher again
        if reason is not None:
            log.info(
                "request %s starts from its prompt: checkpoint void (%s)", msg.request_id, reason,
                extra={"request_id": msg.request_id},
            )  # fmt: skip
            return
        for token in tokens:
            request.append_output_token(token)
        request.first_delta_sent = True

    def abort_request(self, request_id: str) -> RequestDelta | None:
        """Finish a live request with "abort", freeing its blocks now. None if unknown."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        if request.status is RUNNING:
            self.running.remove(request)
        elif self.offload is None or not self.offload.is_loading(request_id):
            self.waiting.remove(request)  # (a loading request is in no queue)
        self.num_aborted += 1
        self._finish(request, "abort")
        return _final_delta(request_id, request.num_output_tokens, "abort")

    def release_prefilled(self, request_id: str) -> bool:
        """Prefill role: the request's prompt KV is in the offload tier and a decode scheduler
        has it now: free it here without a delta (the decode side answers the client). False
        when it is not running (aborted, or recomputing after a worker reset)."""
        request = self.requests.get(request_id)
        if request is None or request.status is not RUNNING:
            return False
        self.running.remove(request)
        self._finish(request, "stop")
        return True

    def get_request(self, request_id: str) -> Request | None:
        return self.requests.get(request_id)

    def has_work(self) -> bool:
        return bool(self.requests)

    # ----------------------------------------------------------------------------- schedule

    def schedule(self) -> StepPlan | None:
        """The next step's plan, or None when nothing can run (pending removals then wait for
        the next plan)."""
        budget = self.config.max_num_batched_tokens
        kv = self.kv
        num_scheduled: dict[str, int] = {}
        cached: list[CachedRequestData] = []
        new: list[NewRequestData] = []
        spec_tokens: dict[str, list[int]] = {}
        spec_lookahead: dict[str, int] = {}
        sampling: list[str] = []  # requests that get a token from this step
        preempted = False

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(
                request.num_tokens + request.num_output_placeholders - request.num_computed_tokens,
                budget,
                self._prefill_cap,
            )
            if num_new <= 0 or self._stops_before_placeholder(request):
                i += 1  # scheduled up to its known tokens, or its in-flight token is its last
                continue
            if request.num_output_placeholders and request.request_id in self.structured:
                # Its next bitmask row needs the token in flight (the service stops planning
                # ahead once a grammar request runs, but one admitted while plans were out
                # ahead can have its prefill in flight with them).
                i += 1
                continue
            verify = self._verify_slots(request, num_new, budget)
            if verify is None:
                i += 1  # its slots would be cut by in-flight ones: planned from results
                continue
            drafts, slots, on_worker = verify
            num_new += slots  # lookahead slots for the drafts
            num_kv = self.spec.slots_to_allocate(request, num_new) if on_worker else num_new
            new_blocks = kv.allocate_slots(request, num_kv) if num_kv else kv.no_blocks
            while new_blocks is None:
                victim, index = self._pop_victim()
                if victim.request_id in num_scheduled:  # earlier in this pass (priority)
                    budget += self._unschedule(
                        victim, num_scheduled, cached, spec_tokens, spec_lookahead, sampling
                    )
                if index < i:
                    i -= 1  # `request` moved up one
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
                new_blocks = kv.allocate_slots(request, num_kv)
            if new_blocks is None:
                # It preempted itself. The requests after it still run: under fcfs there are
                # none, under priority they are more urgent. (vLLM ends the pass here and its
                # engine loop plans again at once; a plan left empty here would idle the
                # service's loop until its next wake-up.)
                continue
            cached.append(
                _cached_request_data(
                    request_id=request.request_id,
                    new_block_ids=[[b.block_id for b in g] for g in new_blocks],
                    num_computed_tokens=request.num_computed_tokens,
                )
            )
            num_scheduled[request.request_id] = num_new
            ahead = 0  # placeholders beyond the one sampled token: the worker's own drafts
            if drafts:
                spec_tokens[request.request_id] = drafts
            elif on_worker and num_new == 1 + slots:
                # every decode of such a request, 0 slots too: num_computed_tokens may count
                # slots still in flight, and the worker keeps its own count for listed ones
                spec_lookahead[request.request_id] = ahead = slots
            request.num_computed_tokens += num_new
            self._note_sampling(request, sampling, ahead)
            budget -= num_new
            i += 1

        # Requests waiting for another request's load of their next block: set aside for this
        # step, then back in their place (services/scheduler/offload: HOLD).
        held: list[Request] = []
        if not preempted:
            max_seqs = self.config.max_num_seqs
            while self.waiting and budget > 0 and len(self.running) < max_seqs:
                request = self.waiting[0]
                if self.offload is None:
                    hit_blocks, num_hit = kv.get_computed_blocks(request)
                else:
                    self.offload.cost.batch_running = bool(self.running)
                    admission = self.offload.admit(request, kv)
                    if admission.action == "defer":
                        break  # lookup unanswered (or no room): in order, as a failed allocation
                    if admission.action == "hold":
                        held.append(self.waiting.popleft())
                        continue
                    if admission.action == "load":
                        self.waiting.popleft()  # computes nothing until its load is done
                        continue
                    hit_blocks, num_hit = admission.hit_blocks, admission.num_hit_tokens
                num_new = min(request.num_tokens - num_hit, budget, self._prefill_cap)
                if kv.allocate_slots(request, num_new, hit_blocks, num_hit) is None:
                    break  # in queue order: nobody overtakes the head of the queue
                self.waiting.popleft()
                kv.record_admission(request, num_hit)
                if request.num_cached_tokens < 0:
                    request.num_cached_tokens = num_hit
                request.status = RUNNING
                self.running.append(request)
                new.append(
                    _new_request_data(
                        request_id=request.request_id,
                        token_ids=list(request.all_token_ids),
                        num_prompt_tokens=request.num_prompt_tokens,
                        block_ids=kv.get_block_ids(request.request_id),
                        num_computed_tokens=num_hit,
                        sampling=request.sampling,
                        return_routed_experts=request.return_routed_experts,
                    )
                )
                self._worker_known.add(request.request_id)
                num_scheduled[request.request_id] = num_new
                request.num_computed_tokens = num_hit + num_new
                self._note_sampling(request, sampling)
                budget -= num_new
        self.waiting.extendleft(reversed(held))

        if not num_scheduled and not (self.offload and self.offload.has_pending_loads()):
            return None
        grammar_ids, grammar_bitmask = self._grammar_bitmask(num_scheduled, spec_tokens)
        plan = _step_plan(
            step_id=self.step_id,
            scheduler_id=self.scheduler_id,
            worker_incarnation=self.worker_incarnation,
            new_requests=new,
            cached_requests=cached,
            num_scheduled_tokens=num_scheduled,
            finished_request_ids=self._finished_for_worker,
            preempted_request_ids=self._preempted_for_worker,
            grammar_request_ids=grammar_ids,
            grammar_bitmask=grammar_bitmask,
            spec_token_ids=spec_tokens,
            spec_lookahead=spec_lookahead,
        )
        if self.offload is not None:
            plan.kv_loads, plan.kv_stores = self.offload.plan_transfers(num_scheduled, kv)
        self._finished_for_worker = []
        self._preempted_for_worker = []
        self._in_flight.add(self.step_id)
        self._sampling_steps[self.step_id] = sampling
        if unwritten := kv.take_newly_cached():
            self._unwritten[self.step_id] = unwritten
        self.step_id += 1
        return plan

    # ------------------------------------------------------------------------------ update

    def update_from_output(self, plan: StepPlan, result: StepResult) -> SchedulerOutput:
        """Apply a step's result: append sampled tokens, stop checks, free finished requests.
        Requests whose prefill chunk was partial get no tokens; tokens after a stop are
        dropped."""
        if result.step_id != plan.step_id:
            raise ValueError(f"result of step {result.step_id} applied to plan {plan.step_id}")
        if result.error is not None:
            return self.step_failed(plan, result.error)
        sampling = self._sampling_steps.get(plan.step_id, ())
        if not self._settle(plan):
            return SchedulerOutput()
        if self.offload is not None:  # the tier's cost model learns this machine's prefill rate
            self.offload.cost.observe_step(
                sum(plan.num_scheduled_tokens.values()), result.execute_ms / 1000
            )
        out = SchedulerOutput()
        sampled = {s.request_id: s for s in result.sampled}
        missing: list[Request] = []
        finished = False
        for request_id in plan.num_scheduled_tokens:
            request = self.requests.get(request_id)
            if request is None or request.status is not RUNNING:
                continue  # aborted (or reset) while the step ran
            if request.routed_experts is not None and request_id in sampled:
                request.routed_experts.record(sampled[request_id], planned_end(plan, request_id))
            if request.prompt_logprobs is not None and request_id in sampled:
                request.prompt_logprobs.record(sampled[request_id])
            if request_id not in sampling:
                continue  # partial prefill: nothing sampled
            slots = plan.spec_lookahead.get(request_id, 0)  # the worker's own drafts
            request.num_output_placeholders -= 1 + slots
            request.num_lookahead_placeholders -= slots
            tokens = sampled.get(request_id)
            if tokens is None or not tokens.token_ids:
                missing.append(request)
                continue
            drafts = plan.spec_token_ids.get(request_id)
            if drafts:  # roll back past the rejected drafts before appending
                self.spec.on_verified(request, len(drafts), len(tokens.token_ids))
            elif slots:
                self.spec.on_verified(request, slots, len(tokens.token_ids), tokens.num_drafts)
            if self._append_sampled(request, tokens, out):
                finished = True
            elif self.spec.k:
                if drafts or slots:  # register blocks the accepted drafts filled: verified KV
                    # only (steps planned ahead count their slots in num_computed_tokens)
                    verified = min(request.num_computed_tokens, request.num_tokens - 1)
                    self.kv.cache_blocks(request, verified)
                if not self._drafts_on_worker(request):
                    self.spec.on_proposed(request, tokens.draft_token_ids, self.structured)
        if finished:
            self.running = [r for r in self.running if r.status is RUNNING]
        if missing:
            self._recompute(missing, "the worker returned no token for a sampled request", out)
        return out

    def step_failed(self, plan: StepPlan, error: str) -> SchedulerOutput:
        """The worker could not run `plan`: recompute its requests from scratch. The blocks the
        plan registered at allocation may hold no (or half-written) KV, so they are unregistered
        first; hits on blocks of earlier, successful steps stay valid (a step only writes slots
        at or after each request's computed tokens, never a block cached before it). A request
        failing `max_step_failures` times finishes with "error"."""
        if plan.step_id not in self._in_flight:
            return SchedulerOutput()
        self.kv.uncache(self._unwritten.get(plan.step_id, ()))
        self._settle(plan)
        self.num_step_failures += 1
        failed = [
            r
            for rid in plan.num_scheduled_tokens
            if (r := self.requests.get(rid)) is not None and r.status is RUNNING
        ]
        out = SchedulerOutput()
        self._recompute(failed, error, out)
        return out

    def reset_worker_state(self, worker_incarnation: str = "") -> None:
        """The worker restarted and holds nothing: every running request recomputes (keeping
        its outputs) and is sent again as new; the prefix cache is dropped, since no cached
        block has KV on the new worker."""
        if self.offload is not None:  # loads are void: requeued (fcfs: behind the running ones)
            self.waiting.extendleft(reversed(self.offload.worker_reset(self.kv)))
        for request in self.running:
            self.kv.free(request)
            request.status = RequestStatus.PREEMPTED
            request.num_computed_tokens = 0
            request.num_output_placeholders = 0
            request.num_lookahead_placeholders = 0
        self.waiting.extendleft(reversed(self.running))
        self.running = []
        self._worker_known.clear()
        self._in_flight.clear()
        self._sampling_steps.clear()
        self._unwritten.clear()
        self._finished_for_worker = []
        self._preempted_for_worker = []
        self.kv.reset_prefix_cache()
        self.worker_incarnation = worker_incarnation

    def kv_load_done(
        self, transfer_id: str, ok: bool, failed_keys: list[str]
    ) -> LoadOutcome | None:
        """The worker answered a KV load (or the edge could not pin it): the request goes back
        to the waiting queue (its front, or its place by priority), its loaded blocks computed,
        or freed to recompute."""
        if self.offload is None:
            return None
        outcome = self.offload.load_done(transfer_id, ok, failed_keys, self.kv)
        if outcome is not None and outcome.requeued is not None:
            self.waiting.appendleft(outcome.requeued)
        return outcome

    def snapshot(self) -> SchedulerSnapshot:
        stats = self.kv.stats
        state_pool = self.kv.state_pool
        return SchedulerSnapshot(
            step_id=self.step_id,
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_free_blocks=self.kv.pool.num_free_blocks,
            num_usable_blocks=self.kv.pool.num_usable_blocks,
            num_free_state_blocks=state_pool.num_free_blocks if state_pool else 0,
            num_usable_state_blocks=state_pool.num_usable_blocks if state_pool else 0,
            kv_usage_percent=100.0 * self.kv.usage,
            prefix_cache_queries=stats.queries,
            prefix_cache_hits=stats.hits,
            prefix_cache_hit_rate=stats.hit_rate,
            num_preemptions=self.num_preemptions,
            num_finished=self.num_finished,
            num_aborted=self.num_aborted,
            num_step_failures=self.num_step_failures,
        )

    # ----------------------------------------------------------------------------- helpers

    def _append_sampled(
        self, request: Request, sampled: SampledTokens, out: SchedulerOutput
    ) -> bool:
        """Append tokens one by one with a stop check after each; emit the delta. True if the
        request finished."""
        start = request.num_output_tokens
        decision = None
        tokens = sampled.token_ids
        grammar = self.structured.accept(request.request_id, request.all_token_ids, tokens)
        if grammar is not None:  # a constrained request: tokens past a rejection are dropped
            tokens = tokens[: grammar.num_tokens]
        for token in tokens:
            request.append_output_token(token)
            decision = check_stop(request, self._eos, self.config.max_model_len)
            if decision is not None:
                break
        if decision is None and grammar is not None and grammar.finish_reason is not None:
            decision = grammar.finish_reason, grammar.stop_token_id
        n = request.num_output_tokens - start
        delta = _request_delta(
            request_id=request.request_id,
            start_index=start,
            token_ids=request.output_token_ids[start:],
        )
        if sampled.logprobs is not None:
            delta.logprobs = sampled.logprobs[:n]
        if sampled.top_token_ids is not None and sampled.top_logprobs is not None:
            k = len(sampled.top_token_ids) // len(sampled.token_ids)
            delta.top_token_ids = sampled.top_token_ids[: n * k]
            delta.top_logprobs = sampled.top_logprobs[: n * k]
        if request.routed_experts is not None:
            request.routed_experts.attach(delta)
        if request.prompt_logprobs is not None:
            request.prompt_logprobs.attach(delta)
        if not request.first_delta_sent:
            request.first_delta_sent = True
            delta.num_prompt_tokens = request.num_prompt_tokens
            delta.num_cached_tokens = max(request.num_cached_tokens, 0)
        if decision is not None:
            delta.finish_reason, delta.stop_token_id = decision
            if grammar is not None and decision[0] == "error":
                delta.error = grammar.error
                if grammar.invalid_request:
                    delta.error_type = "invalid_request_error"
            self._finish(request, decision[0])
            out.finished_request_ids.append(request.request_id)
        out.add(request.reply_stream, delta)
        return decision is not None

    def _finish(self, request: Request, reason: FinishReason) -> None:
        """Release everything the request holds; the caller removes it from its queue."""
        request.status = RequestStatus.finished(reason)
        if self.offload is not None:
            self.offload.request_finished(request, self.kv)  # frees now, or after its load
        else:
            self.kv.free(request)
        self.structured.remove(request.request_id)
        self.spec.forget(request.request_id)
        del self.requests[request.request_id]
        self.num_finished += 1
        if request.request_id in self._worker_known:
            self._worker_known.discard(request.request_id)
            self._finished_for_worker.append(request.request_id)

    def _pop_victim(self) -> tuple[Request, int]:
        """Take the request to preempt out of `running`, with the index it had there: the last
        admitted ("fcfs"), or the least urgent, largest `priority_key` ("priority": vLLM v1's
        `max(running, key=(priority, arrival_time))`), which may precede the request that
        needs the block."""
        running = self.running
        if self.config.scheduling_policy == "fcfs":
            return running.pop(), len(running)
        index = max(range(len(running)), key=lambda k: priority_key(running[k]))
        return running.pop(index), index

    def _unschedule(
        self,
        request: Request,
        num_scheduled: dict[str, int],
        cached: list[CachedRequestData],
        spec_tokens: dict[str, list[int]],
        spec_lookahead: dict[str, int],
        sampling: list[str],
    ) -> int:
        """Take a preemption victim back out of the plan being built (it was scheduled earlier
        in the running pass); returns its tokens to the step budget. Its counters are reset by
        `_preempt`; the blocks its allocation registered will not be written by this step, so
        they are unregistered before `_preempt` frees them (as for a failed step)."""
        rid = request.request_id
        self.kv.uncache_newly_cached(request)
        cached[:] = [c for c in cached if c.request_id != rid]
        spec_tokens.pop(rid, None)
        spec_lookahead.pop(rid, None)
        if rid in sampling:
            sampling.remove(rid)
        return num_scheduled.pop(rid)

    def _preempt(self, request: Request) -> None:
        """Recompute later: blocks freed (their cached prefix usually survives in the free
        queue, so resumption is often a prefix hit), back to the waiting queue (its front, or
        its place by priority)."""
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_output_placeholders = 0
        request.num_lookahead_placeholders = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        self._drop_from_worker(request.request_id)

    def _recompute(self, requests: list[Request], error: str, out: SchedulerOutput) -> None:
        """Put running requests back in the waiting queue (at its front in their order, or in
        their place by priority); ones that failed too often finish with "error"."""
        if not requests:
            return
        requeue: list[Request] = []
        for request in requests:
            request.num_step_failures += 1
            self.kv.free(request)
            request.num_computed_tokens = 0
            request.num_output_placeholders = 0
            request.num_lookahead_placeholders = 0
            self._drop_from_worker(request.request_id)
            if request.num_step_failures >= self.config.max_step_failures:
                self._finish(request, "error")
                out.add(
                    request.reply_stream,
                    _final_delta(
                        request.request_id, request.num_output_tokens, "error", error=error
                    ),
                )
                out.finished_request_ids.append(request.request_id)
            else:
                request.status = RequestStatus.PREEMPTED
                requeue.append(request)
        gone = {id(r) for r in requests}
        self.running = [r for r in self.running if id(r) not in gone]
        self.waiting.extendleft(reversed(requeue))

    def _grammar_bitmask(
        self, num_scheduled: dict[str, int], drafts: dict[str, list[int]]
    ) -> tuple[list[str], bytes]:
        """One bitmask row per constrained request that samples this step (its computed
        tokens reach its known tokens; a partial prefill samples nothing), plus one per draft
        it verifies."""
        if not self.structured:
            return [], b""
        sampling = [
            (rid, request.all_token_ids)
            for rid in num_scheduled
            if rid in self.structured
            and (request := self.requests[rid]).num_computed_tokens >= request.num_tokens
        ]
        return self.structured.grammar_bitmask(sampling, drafts)

    def can_pipeline(self) -> bool:
        """Whether the next step may be planned before the in-flight one's result is back.

        Planning ahead needs every sampled token to be fed forward by the worker without the
        scheduler looking at it. Requests whose next step depends on the token itself are
        planned one step at a time: a grammar's bitmask, drafts the scheduler carries (the
        worker's own drafts in lookahead slots need nothing back: `spec_drafts_on_worker`),
        and routed-expert rows (recorded by computed position)."""
        if self.structured or (self.spec.k and not self.spec.on_worker):
            return False
        return not any(r.routed_experts is not None for r in self.running)

    def _verify_slots(
        self, request: Request, num_new: int, budget: int
    ) -> tuple[list[int], int, bool] | None:
        """For a request scheduled `num_new` tokens: (the drafts the plan carries, the lookahead
        slots, whether the worker brings its own drafts); None: not this step
        (SpecDecoding.lookahead_slots)."""
        if self._drafts_on_worker(request):
            slots = self.spec.lookahead_slots(request, num_new, budget)
            return None if slots is None else ([], slots, True)
        drafts = self.spec.drafts_to_verify(request, num_new, budget)
        return drafts, len(drafts), False

    def _drafts_on_worker(self, request: Request) -> bool:
        """Does the worker verify its own drafts for `request` (lookahead slots, no drafts in
        the plan)? Not for a grammar request (the scheduler validates its drafts) nor one
        recording routed experts (rows by planned position)."""
        return (
            self.spec.on_worker
            and request.routed_experts is None
            and request.request_id not in self.structured
        )

    def _note_sampling(self, request: Request, sampling: list[str], slots: int = 0) -> None:
        """After scheduling `request`: if this step computes up to its last known (or
        placeholder) token, it samples one more, which stays a placeholder until the result;
        with `slots` for the worker's own drafts, 1 + slots placeholders (all counted as
        accepted until the result). A prefill-role scheduler never samples
        (services/scheduler/pd)."""
        if self.prefill_only:
            return
        if request.num_computed_tokens >= request.num_tokens + request.num_output_placeholders:
            request.num_output_placeholders += 1 + slots
            request.num_lookahead_placeholders += slots
            sampling.append(request.request_id)

    def _stops_before_placeholder(self, request: Request) -> bool:
        """A request whose in-flight tokens already reach max_tokens or max_model_len would
        only compute a position whose token is discarded: do not plan it (eos cannot be
        foreseen; that costs a wasted row per request and plan out ahead of its result). Of
        lookahead slots in flight only their step's one sure token counts: a request whose
        drafts were all accepted is skipped by the worker (services/worker/spec/drafts.py)."""
        pending = request.num_output_placeholders - request.num_lookahead_placeholders
        if not pending:
            return False
        return (
            request.num_output_tokens + pending >= request.sampling.max_tokens
            or request.num_tokens + pending >= self.config.max_model_len
        )

    def _settle(self, plan: StepPlan) -> bool:
        """Mark the plan's step as answered; False if it was not in flight (stale or repeat)."""
        if plan.step_id not in self._in_flight:
            return False
        self._in_flight.discard(plan.step_id)
        self._sampling_steps.pop(plan.step_id, None)
        self._unwritten.pop(plan.step_id, None)  # written now (or unregistered by step_failed)
        return True

    def _drop_from_worker(self, request_id: str) -> None:
        if request_id in self._worker_known:
            self._worker_known.discard(request_id)
            self._preempted_for_worker.append(request_id)

    def _admission_error(self, msg: SubmitRequest) -> str | None:
        if msg.priority and self.config.scheduling_policy == "fcfs":
            return (  # vLLM refuses it too, rather than ignore what the client asked for
                "priority scheduling is not enabled (MESHLLM_SCHEDULING_POLICY=fcfs); "
                "priority must be 0"
            )
        if error := prompt_start_error(msg):
            return error
        if error := token_ids_error(msg, self.config.vocab_size):
            return error
        prompt_len = len(msg.prompt_token_ids)
        max_len = self.config.max_model_len
        if prompt_len >= max_len:
            # max_model_len bounds prompt + output: a prompt that fills it leaves no room.
            return (
                f"prompt has {prompt_len} tokens; max_model_len {max_len} leaves no room for output"
            )
        # Peak KV slots: every token but the last sampled one (which finishes the request).
        peak = min(prompt_len + msg.sampling.max_tokens - 1, max_len - 1)
        return self.kv.too_large(peak)


def _final_delta(
    request_id: str, start_index: int, reason: FinishReason, error: str | None = None
) -> RequestDelta:
    return RequestDelta(
        request_id=request_id, start_index=start_index, finish_reason=reason, error=error
    )
