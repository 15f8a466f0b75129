"""One worker step: StepPlan in, StepResult out (no I/O here; the service owns the bus).

`execute(plan)`:
1. applies the plan's diff to the persistent batch (and the sampler's per-row state);
2. builds the flat token batch with vectorized numpy gathers: for every scheduled request the
   tokens [num_computed, num_computed + num_scheduled) of its known tokens, their positions and
   KV slots. Decodes (one token) go first so attention handles them in one batched call;
3. runs the model, computes logits only for requests whose computed tokens reach the end of
   their known tokens (prefill finished, or decoding), and samples them;
4. appends each sampled token to its request (the next plan schedules it without resending),
   advances num_computed_tokens, and returns the sampled tokens.

`execute` is `finish(launch(plan))`. Split, they let a GPU worker overlap steps (asynchronous
scheduling, in_flight.py): `launch` queues step N's work on the device and starts copying its
sampled tokens to the host without waiting; step N+1 can be launched before `finish(N)`, its
inputs for N's tokens gathered on the device. `can_overlap(plan)` says when that is allowed:
drafts, grammars, routed experts and KV transfers need their step's tokens on the host first,
except n-gram verify steps chained on the device (spec/chain.py, spec/chain_step.py).

A plan that does not fit the batch raises `PlanError` before the model runs; part of its diff
may already be applied, so the caller `reset()`s the runner and the scheduler recomputes the
requests (as after any failed step).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from meshllm_kernels.attention.backends import PagedKernelBackend, TritonPagedAttention
from meshllm_kernels.parallel_compile import precompiled
from meshllm_kernels.runtime.compile_watch import CompileWatch
from meshllm_kernels.runtime.staged_copy import stage_to_device
from meshllm_kernels.runtime.tensor_checks import sm_count
from services.worker.accel.chain_graphs import ChainGraphs
from services.worker.accel.cpu_compile import CompiledForward
from services.worker.accel.cuda_graphs import GRAPH_SIZES, DecodeGraphs, padded_size
from services.worker.accel.draft_graphs import (
    BlockGraphs,
    DraftGraphs,
    DraftModelGraphs,
    LoopGraphs,
)
from services.worker.accel.hybrid_graphs import HybridDecodeGraphs
from services.worker.accel.observe_graphs import ContextGraphs, HeadObserveGraphs, ObserveGraphs
from services.worker.accel.prefill_graphs import PrefillGraphs
from services.worker.accel.verify_graphs import VerifyGraphs
from services.worker.attention.backend_choice import resolve_backend
from services.worker.attention.groups import group_attention, needs_group_attention
from services.worker.attention.reference import AttentionMetadata
from services.worker.attention.select import (
    CpuAttention,
    TritonAttentionMetadata,
    build_attention_metadata,
    cpu_decode_kernel,
)
from services.worker.attention.state_metadata import StateMetadata, decode_blocks, decode_read_slots
from services.worker.attention.table_width import WIDTH_MULTIPLE
from services.worker.models.base import CausalLM, split_aux_hidden
from services.worker.runner.in_flight import InFlightTokens, PendingFeed, fed_id
from services.worker.runner.input_batch import InputBatch, PlanError
from services.worker.runner.kv_cache import KVCache
from services.worker.runner.prompt_logprobs import PromptLogprobsTracker
from services.worker.runner.routed_experts import RoutedExpertsTracker
from services.worker.runner.step_timeline import StepMarks, StepTimeline
from services.worker.sampling import SamplerOutput, SamplingState
from services.worker.sampling.draw_variants import compile_draws
from services.worker.spec import SpeculativeConfig
from services.worker.spec.block_drafter import BlockDrafter
from services.worker.spec.chain import DraftChain
from services.worker.spec.chain_step import land_chained, launch_chained
from services.worker.spec.drafts import Drafter, stage_drafts, step_drafts
from services.worker.spec.feature_drafter import FeatureDrafter
from services.worker.spec.verify_step import verify_and_sample
from shared.model.config import ModelConfig
from shared.protocol import SampledTokens, SamplingParams, StepPlan, StepResult
from shared.protocol.trusted import TrustedBuilder

if TYPE_CHECKING:  # the connector's module reaches Redis; the runner only calls it
    from services.worker.kv_offload.connector import KVConnector
    from services.worker.kv_offload.group_blocks import KVFollower

log = logging.getLogger(__name__)
_sampled_tokens = TrustedBuilder(SampledTokens)


def refuse_state_group(speculative: SpeculativeConfig | None, compiled: bool) -> None:
    """What a hybrid model's state layers cannot do yet, refused when the runner is built."""
    from shared.model.config import UnsupportedModelError

    if speculative is not None and speculative.enabled:
        raise UnsupportedModelError(
            "speculative decoding with a state (Mamba) KV cache group is not supported: "
            "rejected drafts would need the recurrent state at every draft position"
        )
    if compiled:
        raise UnsupportedModelError(
            "the compiled CPU forward does not handle state (Mamba) layers: run eagerly"
        )


__all__ = ["LaunchedStep", "ModelRunner", "PlanError", "StepInputs"]


@dataclass
class StepInputs:
    """The host-side description of one forward, in flat-batch order (decodes first)."""

    request_ids: list[str]
    rows: np.ndarray  # [R] batch rows
    query_lens: np.ndarray  # [R]
    seq_lens: np.ndarray  # [R] computed tokens after this step
    input_ids: np.ndarray  # [T]
    positions: np.ndarray  # [T]
    slot_mapping: np.ndarray  # [T]
    sample_mask: np.ndarray  # [R] bool: this request gets a token this step
    num_drafts: np.ndarray | None = None  # [R] drafts verified this step (None: no drafts)
    flat_rows: np.ndarray | None = None  # [T] batch row of every flat token
    fed: np.ndarray | None = None  # flat indices whose token is still only on the device


@dataclass
class LaunchedStep:
    """A step whose work is queued: `finish` turns it into the StepResult."""

    step_id: int
    started: float
    tokens: InFlightTokens | None = None  # sampled tokens on their way to the host
    sampled: list[SampledTokens] | None = None  # or: the results already assembled
    # CUDA: timing events around the step's device work (device_seconds)
    device_span: tuple[torch.cuda.Event, torch.cuda.Event] | None = None
    marks: StepMarks | None = None  # the step timeline's record (step_timeline.py), if on

    def landed(self) -> bool:
        """Its sampled tokens are on the host (its device work is done): finish() won't wait."""
        return self.tokens is None or self.tokens.is_ready()


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        config: ModelConfig,
        kv_cache: KVCache,
        device: torch.device | str = "cpu",
        max_num_reqs: int = 256,
        max_model_len: int = 0,
        worker_id: str = "worker",
        worker_incarnation: str = "",
        speculative: SpeculativeConfig | None = None,
        compiled: bool = False,
        cpu_attention: CpuAttention = "auto",
        device_chain: bool = False,
        draft_graphs: bool = True,
    ) -> None:
        """`compiled`: run the forward and logits compiled (cpu_compile.py; the model's
        linears must be plain nn.Linear, see load_model(compiled=True)). `cpu_attention`: the
        C++ decode attention on CPU ("auto": where it builds; see
        attention_select.cpu_decode_kernel). `device_chain`: with n-gram drafts, verify steps
        planned ahead run from the device's tokens (spec/chain.py) and may overlap.
        `draft_graphs`: capture_cuda_graphs also captures a feature head's draft loop
        (accel/draft_graphs.py; off under tensor parallelism)."""
        self.model = model
        self.draft_graphs = draft_graphs
        self.config = config
        self.kv_cache = kv_cache
        self.device = torch.device(device)
        self.max_model_len = max_model_len or model.max_model_len
        rope_positions = model.rotary.max_position
        if self.max_model_len > rope_positions:
            raise ValueError(
                f"max_model_len={self.max_model_len} exceeds the model's RoPE table of "
                f"{rope_positions} positions (load_model(..., max_model_len=...))"
            )
        self.block_size = kv_cache.block_size
        self.decode_kernel = cpu_decode_kernel(cpu_attention, self.device)
        self.worker_id = worker_id
        self.worker_incarnation = worker_incarnation
        # KV cache groups (shared/kv/groups.py): one block table per group and request.
        self.kv_groups = config.kv_groups
        # The attention backend of every forward, asked of the registry once: a configuration
        # no backend can serve stops here (BackendCapabilityError), not at a step.
        self.attention_backend = resolve_backend(self.device, self.kv_groups, kv_cache.dtype)
        # Hybrid models (attention + Mamba2 layers): a state group whose per-request state is
        # one recurrent state per block boundary (shared/kv/groups.py's entry rule).
        self.has_state_group = any(g.kind == "state" for g in self.kv_groups)
        if self.has_state_group:
            refuse_state_group(speculative, compiled)
        self.batch = InputBatch(
            max_num_reqs,
            self.max_model_len,
            self.block_size,
            num_kv_groups=len(self.kv_groups),
            # A state group's ids index the state pool, the others the attention pool.
            num_cache_blocks=[
                kv_cache.num_state_blocks if g.kind == "state" else kv_cache.num_blocks
                for g in self.kv_groups
            ],
        )
        # Routed experts of MoE models (services/worker/runner/routed_experts.py).
        self.routed_experts = RoutedExpertsTracker(getattr(model, "routed_experts", None))
        self.prompt_logprobs = PromptLogprobsTracker()
        self.sampler = SamplingState(
            max_num_reqs, config.vocab_size, self.device, eos_token_ids=config.eos_token_ids
        )
        # Speculative decoding (services/worker/spec): drafts proposed after each sampling.
        self.drafter = (
            Drafter(
                speculative,
                vocab_size=config.vocab_size,
                max_num_reqs=max_num_reqs,
                max_model_len=self.max_model_len,
                device=self.device,
                target=model,
            )
            if speculative and speculative.enabled
            else None
        )
        self.num_spec_tokens = speculative.num_spec_tokens if speculative and self.drafter else 0
        # Verify steps chained on the device (n-gram drafts, full attention only).
        self.chain: DraftChain | None = None
        if (
            device_chain
            and speculative is not None
            and self.drafter is not None
            and speculative.method == "ngram"
            and not needs_group_attention(self.kv_groups)
        ):
            self.chain = DraftChain(
                max_num_reqs,
                self.max_model_len,
                self.batch.max_blocks_per_req * self.block_size,
                self.num_spec_tokens,
                speculative.prompt_lookup_min,
                speculative.prompt_lookup_max,
                self.device,
            )
        self.compiled = CompiledForward(model) if compiled else None
        # CUDA: decode steps replay CUDA graphs once captured; with a drafter, so do the steps
        # that verify drafts (accel/verify_graphs.py).
        self.graphs: DecodeGraphs | None = None
        self.verify_graphs: VerifyGraphs | None = None
        # CUDA, with a device chain: whole chained verify steps (accel/chain_graphs.py).
        self.chain_graphs: ChainGraphs | None = None
        # CUDA, when asked for (capture_cuda_graphs' prefill_tokens): small prefill and mixed
        # steps replay graphs too (accel/prefill_graphs.py).
        self.prefill_graphs: PrefillGraphs | None = None
        # KV offload (services/worker/kv_offload): None = no stores/loads, the runner as before.
        # Ranks 1..N-1 of a tensor-parallel group hold a KVFollower: their heads of each chunk.
        self.kv_connector: KVConnector | KVFollower | None = None
        # Sampled tokens not on the host yet (asynchronous scheduling, in_flight.py).
        self.feed = PendingFeed(max_num_reqs, self.device)
        # CUDA: copies off the compute stream, so that nothing but the sampling sits between
        # two decode steps' graphs: uploads issued before the step's forward (the graphs'
        # inputs, the sampler's rows), the sampled tokens' download after it.
        cuda = self.device.type == "cuda"
        self.upload_stream = torch.cuda.Stream(self.device) if cuda else None
        self.download_stream = torch.cuda.Stream(self.device) if cuda else None
        # CUDA: seconds the device spent on the last finished step, from its first queued
        # kernel to its last (a step queued behind another starts when that one ends). Summed
        # over a run against its wall time, it gives the share of time the device had no step
        # to run: the mesh's cost once steps overlap.
        self.last_device_seconds = 0.0
        # MESHLLM_STEP_TIMELINE: a line per step with its host and device marks.
        self.timeline: StepTimeline | None = None
        self._marks: StepMarks | None = None  # the launching step's, while the timeline is on
        # CUDA: Triton compiles of this process, those after the warm-up logged as stalls
        # (runner/compile_stalls.py, installed by bootstrap.py).
        self.compile_watch: CompileWatch | None = None
        # CUDA warm-up: Triton compiles in this many threads (MESHLLM_KERNEL_COMPILE_THREADS;
        # None: the CPUs available, at most 16; 1: one by one as launched).
        self.compile_threads: int | None = None

    # -- one step ---------------------------------------------------------------------------

    def execute(self, plan: StepPlan) -> StepResult:
        return self.finish(self.launch(plan))

    def can_overlap(self, plan: StepPlan) -> bool:
        """May the next plan be launched before this one's `finish`? Not when a step's tokens
        must be on the host before the next step is planned or run: drafts (proposed from
        them), grammars (the scheduler advances the matcher), routed experts and prompt
        logprobs (recorded on the host) and KV transfers (copies the connector runs between
        steps)."""
        if (
            plan.spec_token_ids
            or plan.grammar_request_ids
            or plan.kv_stores
            or plan.kv_loads
            or self.routed_experts.wanted
            or self.prompt_logprobs.wanted
        ):
            return False
        return self.drafter is None or self._chains(plan)

    def _chains(self, plan: StepPlan) -> bool:
        """Whether the plan runs as a chained verify step (spec/chain.py): every scheduled
        request decodes in lookahead slots (none new), no draw reads history, the rows' spans
        fit, and on CUDA a verify graph holds the batch (an eager step would read its layout
        on the host)."""
        chain = self.chain
        lookahead = plan.spec_lookahead
        if (
            chain is None
            or not lookahead
            or plan.spec_token_ids
            or plan.grammar_request_ids
            or len(lookahead) != len(plan.num_scheduled_tokens)
            or not self.sampler.draws_read_no_history
        ):
            return False
        graphs = self.verify_graphs
        if self.device.type == "cuda" and (
            graphs is None or padded_size(len(lookahead), graphs.sizes) not in graphs.graphs
        ):
            return False
        new = {n.request_id for n in plan.new_requests}
        rows = []
        for request_id, count in plan.num_scheduled_tokens.items():
            slots = lookahead.get(request_id)
            row = self.batch.req_rows.get(request_id)
            if slots is None or row is None or request_id in new or count != 1 + slots:
                return False
            if not 0 <= slots <= chain.k:
                return False
            rows.append(row)
        return chain.fits(self.batch, np.array(rows, dtype=np.int64))

    @torch.inference_mode()
    def launch(self, plan: StepPlan) -> LaunchedStep:
        """Apply the plan and queue its work; the sampled tokens may still be on the device."""
        step = LaunchedStep(plan.step_id, time.perf_counter())
        if self.timeline is not None:
            step.marks = self._marks = self.timeline.marks()
        if self.device.type == "cuda":
            step.device_span = (
                torch.cuda.Event(enable_timing=True),
                torch.cuda.Event(enable_timing=True),
            )
            step.device_span[0].record()
        if self.kv_connector is not None:  # finished loads into their blocks; queue new ones
            self.kv_connector.before_forward(plan)
        self._apply(plan)
        if self._chains(plan):
            step.tokens = launch_chained(self, plan, step.marks)
            inputs = None
        else:
            if any(t.chained is not None for t in self.feed.steps):
                # the host's tokens of those rows are behind the device's until they land
                # (the service finishes them first: can_overlap said no to this plan)
                raise PlanError("a step run on the host while chained verify steps are in flight")
            inputs = self.prepare_inputs(plan) if plan.num_scheduled_tokens else None
        if inputs is not None:
            if step.marks is not None:
                step.marks.shape(inputs.query_lens, inputs.num_drafts)
            self.mark_phase("inputs")
            out = self._run(inputs, plan)
            if isinstance(out, InFlightTokens):
                step.tokens = out
            else:
                step.sampled = out
        if self.kv_connector is not None:  # stores leave the blocks before the next plan
            self.kv_connector.after_forward(plan)
        if step.device_span is not None:
            step.device_span[1].record()
        if step.marks is not None:
            step.marks.queued = time.perf_counter()
            self._marks = None
        return step

    def mark_phase(self, name: str) -> None:
        """A named mark of the launching step in the step timeline (step_timeline.py), if on."""
        if self._marks is not None and self.timeline is not None:
            self.timeline.phase(self._marks, name)

    def finish(self, step: LaunchedStep) -> StepResult:
        """Wait for the step's tokens, append them to their requests, and build the result."""
        sampled = step.sampled or []
        if step.tokens is not None:
            sampled = self._land(step.tokens)
            if step.marks is not None and self.timeline is not None:
                self.timeline.phase(step.marks, "landed", device=False)
        if step.device_span is not None:
            start, end = step.device_span
            end.synchronize()  # recorded right after the token copies: no extra wait
            self.last_device_seconds = start.elapsed_time(end) / 1000.0
        if self.timeline is not None and step.marks is not None:
            self.timeline.write(step.step_id, step.marks, step.device_span)
        if self.prompt_logprobs.wanted:
            sampled = self.prompt_logprobs.attach(sampled)
        return StepResult(
            step_id=step.step_id,
            worker_id=self.worker_id,
            worker_incarnation=self.worker_incarnation,
            sampled=sampled,
            execute_ms=(time.perf_counter() - step.started) * 1000.0,
        )

    def _land(self, tokens: InFlightTokens) -> list[SampledTokens]:
        tokens.wait()
        live = self.feed.landed(tokens)
        if tokens.chained is not None:
            return land_chained(self, tokens, live)
        host_ids = tokens.host.token_ids.numpy()
        self.batch.append_sampled(tokens.rows[live], host_ids[live])
        return self._sampled_tokens(tokens, host_ids)

    def _apply(self, plan: StepPlan) -> None:
        changes = self.batch.apply(plan)
        self.routed_experts.apply(plan)
        self.prompt_logprobs.apply(plan)
        for row in changes.removed_rows:
            self.sampler.remove_request(row)
            self.feed.drop(row)
            if self.drafter is not None:
                self.drafter.release(row)
            if self.chain is not None:
                self.chain.forget(row)
        for row, new in changes.added:
            if self.chain is not None:
                self.chain.forget(row)
            try:
                self.sampler.add_request(
                    row,
                    new.sampling,
                    list(new.token_ids[: new.num_prompt_tokens]),
                    list(new.token_ids[new.num_prompt_tokens :]),
                )
            except ValueError as exc:  # e.g. token ids outside the vocabulary
                self.batch.remove(new.request_id)
                raise PlanError(f"{new.request_id}: {exc}") from exc

    def reset(self) -> None:
        """Forget every request (after a failed step: the scheduler recomputes them). The KV
        cache tensors stay; their contents are simply no longer referenced."""
        self.routed_experts.clear()
        self.prompt_logprobs.clear()
        self.feed.clear()
        if self.chain is not None:
            self.chain.reset()
        for request_id in list(self.batch.req_rows):
            row = self.batch.remove(request_id)
            if row is not None:
                self.sampler.remove_request(row)
                if self.drafter is not None:
                    self.drafter.release(row)
        if self.kv_connector is not None:  # pending loads/stores are reported failed
            self.kv_connector.reset()

    def prepare_inputs(self, plan: StepPlan) -> StepInputs | None:
        """Flat token batch for the plan's scheduled requests (the diff already applied); None
        when none of them is left to compute."""
        batch = self.batch
        ids = list(plan.num_scheduled_tokens)
        try:
            rows = np.fromiter((batch.req_rows[r] for r in ids), dtype=np.int64, count=len(ids))
        except KeyError as exc:
            raise PlanError(f"{exc.args[0]}: scheduled but not in the worker's batch") from None
        counts = np.fromiter(plan.num_scheduled_tokens.values(), dtype=np.int64, count=len(ids))
        book = self.drafter.book if self.drafter is not None else None
        if self.drafter is not None and plan.spec_lookahead:
            # rows whose last steps ran chained have no host proposal yet
            self.drafter.propose_missing(batch, plan.spec_lookahead, self.sampler)
        # the plan's drafts, and the worker's own in its lookahead slots (counts shrink to them)
        drafts = step_drafts(plan, book, batch, ids, rows, counts)
        if not counts.all():  # requests already at max_tokens (step_drafts): not computed
            kept = np.flatnonzero(counts)
            rows, counts, ids = rows[kept], counts[kept], [ids[i] for i in kept]
            if not ids:
                return None
        order = np.argsort(counts != 1, kind="stable")  # decodes first, otherwise plan order
        rows, counts = rows[order], counts[order]
        ids = [ids[i] for i in order]
        starts = batch.num_computed_tokens[rows]
        ends = starts + counts
        known = batch.num_tokens[rows] + self.feed.pending(rows)  # + a token still on the device
        # Rows may hold sampled drafts the plan did not carry: those are verified too
        # (services/worker/spec/proposals.py), so the step takes the verification path.
        verifying = drafts or (book is not None and book.has_sampled)
        num_drafts = stage_drafts(batch, drafts, ids, rows) if verifying else None
        if num_drafts is not None:
            known = known + num_drafts  # drafts are this step's inputs after the known tokens
        self._check(ids, counts, ends, known, rows)
        cu = np.cumsum(counts)
        flat_rows = np.repeat(rows, counts)
        positions = np.arange(int(cu[-1])) + np.repeat(starts - (cu - counts), counts)
        blocks = batch.block_tables[0, flat_rows, positions // self.block_size]
        try:
            fed = self.feed.gather(flat_rows, positions, batch.num_tokens)
        except ValueError as exc:
            raise PlanError(str(exc)) from None
        return StepInputs(
            request_ids=ids,
            rows=rows,
            query_lens=counts,
            seq_lens=ends,
            input_ids=batch.token_ids[flat_rows, positions],
            positions=positions,
            slot_mapping=blocks * self.block_size + positions % self.block_size,
            sample_mask=ends == known,
            num_drafts=num_drafts,
            flat_rows=flat_rows,
            fed=fed,
        )

    def _check(
        self,
        ids: list[str],
        counts: np.ndarray,
        ends: np.ndarray,
        known: np.ndarray,
        rows: np.ndarray,
    ) -> None:
        bad = np.flatnonzero((counts < 1) | (ends > known))
        if bad.size:
            i = int(bad[0])
            raise PlanError(
                f"{ids[i]}: {int(counts[i])} tokens scheduled up to {int(ends[i])}, "
                f"but {int(known[i])} tokens known"
            )
        needed = -(-ends // self.block_size)
        short = np.flatnonzero(needed > self.batch.num_blocks[0, rows])
        if short.size:
            i = int(short[0])
            raise PlanError(
                f"{ids[i]}: {int(ends[i])} tokens need {int(needed[i])} blocks, "
                f"it holds {int(self.batch.num_blocks[0, rows[i]])}"
            )

    def _run(self, inputs: StepInputs, plan: StepPlan) -> list[SampledTokens] | InFlightTokens:
        recording = self.routed_experts.begin(inputs.request_ids)
        sample_idx = np.flatnonzero(inputs.sample_mask)
        # The sampler's state rows and positions (= tokens before the new one), uploaded
        # before the forward so the copy is done by the time the sampling needs it.
        sampler_rows = (
            self._upload_ahead(np.stack([inputs.rows[sample_idx], inputs.seq_lens[sample_idx]]))
            if sample_idx.size and inputs.num_drafts is None
            else None
        )
        hidden, aux = split_aux_hidden(
            self._forward(inputs, eager=bool(recording)), self.config.hidden_size
        )
        self.mark_phase("forward")
        if recording:
            self.routed_experts.collect(inputs.request_ids, inputs.query_lens)
        self.batch.num_computed_tokens[inputs.rows] = inputs.seq_lens
        if self.prompt_logprobs.wanted:
            self.prompt_logprobs.collect(
                hidden, inputs.request_ids, inputs.query_lens, inputs.seq_lens, self.compute_logits
            )
            self.mark_phase("prompt logprobs")
        if inputs.num_drafts is not None:
            sampled = verify_and_sample(self, hidden, inputs, plan)
            self.mark_phase("verified")
            return self._propose(sampled, hidden, aux, inputs)
        if sampler_rows is None:
            return self._propose([], hidden, aux, inputs)
        last_rows = np.cumsum(inputs.query_lens)[sample_idx] - 1
        if len(last_rows) == hidden.shape[0] and last_rows[-1] == len(last_rows) - 1:
            last = hidden  # every row is one token, sampled (a decode-only step): no gather
        else:
            last = hidden[self._to_device(last_rows)]
        # Waited for before the LM head, so the sampling's launch follows the LM head's directly
        # (programmatic dependent launch, meshllm_kernels/sampling/gumbel_kernel.py).
        rows_t, positions = self._uploaded(sampler_rows)
        logits = self.compute_logits(last)
        rows = inputs.rows[sample_idx]
        bitmask, bitmask_index = self._bitmask(plan, [inputs.request_ids[i] for i in sample_idx])
        out = self.sampler.sample(
            logits, rows_t, positions, bitmask, bitmask_index=bitmask_index, feed=self.feed.latest
        )
        self.sampler.record_sampled(rows_t, out.token_ids)
        tokens = InFlightTokens.start(
            [inputs.request_ids[i] for i in sample_idx],
            rows,
            [self.batch.sampling[int(row)] for row in rows],
            out,
            self.download_stream,
        )
        self.feed.launched(tokens)
        if self.drafter is None:
            return tokens
        return self._propose(self._land(tokens), hidden, aux, inputs)

    def _propose(
        self,
        sampled: list[SampledTokens],
        hidden: torch.Tensor,
        aux: torch.Tensor | None,
        inputs: StepInputs,
    ) -> list[SampledTokens]:
        """Attach each sampled request's drafts for its next step (speculative decoding). A
        feature drafter (EAGLE, EAGLE-3, MTP) first takes the step's hidden states (every row,
        sampled or not; `aux`: the target's auxiliary layer states, for EAGLE-3)."""
        if self.drafter is None:
            return sampled
        batch = self.batch
        self.drafter.observe(batch, hidden, aux, inputs.rows, inputs.query_lens, inputs.seq_lens)
        if self.drafter.features is not None:  # a head fed the step's features
            self.mark_phase("observed")
        if not sampled:
            return sampled
        rows = np.array([batch.req_rows[s.request_id] for s in sampled], dtype=np.int64)
        for s, drafts in zip(sampled, self.drafter.propose(batch, rows, self.sampler), strict=True):
            if drafts:
                s.draft_token_ids = drafts
        self.mark_phase("proposed")
        return sampled

    def _forward(self, inputs: StepInputs, eager: bool = False) -> torch.Tensor:
        """hidden [T, H] of the step: a CUDA graph replay for decode-only steps, for steps
        that verify drafts (every request at most k + 1 tokens) of a captured size and, where
        captured, for prefill and mixed steps of up to the largest prefill graph's tokens;
        otherwise an eager forward. Eager too when the step records routed experts (the hooks run in
        Python) or the model has sliding-window groups (the graphs hold one full-attention
        metadata)."""
        tables = self.batch.block_tables[0, inputs.rows]
        if (
            self.verify_graphs is not None
            and not eager
            and inputs.num_drafts is not None
            and inputs.num_drafts.any()
            and inputs.fed is None
            and not needs_group_attention(self.kv_groups)
        ):
            layout = self.verify_graphs.layout(
                inputs.query_lens, inputs.seq_lens, inputs.input_ids, inputs.positions,
                inputs.slot_mapping,
            )  # fmt: skip
            if layout is not None:
                return self.verify_graphs.run(layout, tables)
        hybrid = isinstance(self.graphs, HybridDecodeGraphs)
        if (
            self.graphs is not None
            and not eager
            and (inputs.num_drafts is None or not inputs.num_drafts.any())
            and (hybrid or not needs_group_attention(self.kv_groups))
            and self.graphs.fits(inputs.query_lens)
        ):
            input_ids = inputs.input_ids
            if inputs.fed is not None and inputs.flat_rows is not None:
                input_ids = input_ids.copy()  # the fed tokens are read on the device
                input_ids[inputs.fed] = fed_id(inputs.flat_rows[inputs.fed])
            if isinstance(self.graphs, HybridDecodeGraphs):  # groups [full, state]: capture
                read, write = decode_blocks(
                    self.batch.block_tables[1, inputs.rows], inputs.seq_lens, self.block_size
                )
                return self.graphs.run_hybrid(
                    input_ids, inputs.positions, inputs.slot_mapping, inputs.seq_lens, tables,
                    decode_read_slots(read, inputs.seq_lens - 1), write.astype(np.int32),
                )  # fmt: skip
            return self.graphs.run(
                input_ids, inputs.positions, inputs.slot_mapping, inputs.seq_lens, tables
            )
        if (
            self.prefill_graphs is not None
            and not eager
            and (inputs.num_drafts is None or not inputs.num_drafts.any())
            and not needs_group_attention(self.kv_groups)
        ):
            prefill = self.prefill_graphs.layout(
                inputs.query_lens, inputs.seq_lens, inputs.input_ids, inputs.positions,
                inputs.slot_mapping,
            )  # fmt: skip
            if prefill is not None:
                self.prefill_graphs.stage(prefill, tables)
                self._feed_ids(self.prefill_graphs.static["input_ids"], inputs)
                return self.prefill_graphs.replay(prefill)
        attn: (
            AttentionMetadata
            | TritonAttentionMetadata
            | list[AttentionMetadata | TritonAttentionMetadata | StateMetadata]
        )
        if needs_group_attention(self.kv_groups):  # sliding windows, states: per-group tables
            attn = self._group_attention(
                inputs.rows, inputs.query_lens, inputs.seq_lens, inputs.positions
            )
        else:
            attn = self._metadata(
                query_lens=inputs.query_lens,
                seq_lens=inputs.seq_lens,
                block_tables=tables,
                slot_mapping=inputs.slot_mapping,
            )
        input_ids = self._to_device(inputs.input_ids)
        self._feed_ids(input_ids, inputs)
        return self.model_forward(input_ids, self._to_device(inputs.positions), attn)

    def _group_attention(
        self,
        rows: np.ndarray,
        query_lens: np.ndarray,
        seq_lens: np.ndarray,
        positions: np.ndarray,
        block_tables: np.ndarray | None = None,
    ) -> list[AttentionMetadata | TritonAttentionMetadata | StateMetadata]:
        return group_attention(
            self.kv_groups,
            self.batch.block_tables if block_tables is None else block_tables,
            rows,
            query_lens,
            seq_lens,
            positions,
            self.block_size,
            self.device,
            self.decode_kernel,
            backend=self.attention_backend,
            num_kv_heads=self.config.num_key_value_heads,
        )

    def model_forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata
        | TritonAttentionMetadata
        | Sequence[AttentionMetadata | TritonAttentionMetadata | StateMetadata],
    ) -> torch.Tensor:
        """hidden [T, H]: the compiled forward where there is one (cpu_compile.py)."""
        if self.compiled is not None:
            # a model with state layers never compiles (refuse_state_group): every layer's
            # cache is a K/V tensor here
            return self.compiled.forward(
                input_ids,
                positions,
                attn,  # type: ignore[arg-type]
                self.kv_cache.attention_layers,
            )
        hidden: torch.Tensor = self.model(input_ids, positions, attn, self.kv_cache.layers)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.compiled is not None:
            return self.compiled.compute_logits(hidden)
        return self.model.compute_logits(hidden)

    def _feed_ids(self, input_ids: torch.Tensor, inputs: StepInputs) -> None:
        """Write the tokens still on the device (sampled by a step not finished yet) into the
        step's device input ids, in stream order after that step's sampling."""
        if inputs.fed is None or inputs.flat_rows is None:
            return
        at, rows = self._to_device(np.stack([inputs.fed, inputs.flat_rows[inputs.fed]]))
        input_ids[at] = self.feed.latest[rows]

    def _metadata(self, **arrays: np.ndarray) -> AttentionMetadata | TritonAttentionMetadata:
        """Attention metadata for this runner's device (Triton kernels on CUDA)."""
        return build_attention_metadata(
            block_size=self.block_size,
            num_kv_heads=self.config.num_key_value_heads,
            backend=self.attention_backend,
            device=self.device,
            decode_kernel=self.decode_kernel,
            **arrays,  # type: ignore[arg-type]
        )

    def capture_cuda_graphs(
        self, sizes: tuple[int, ...] = GRAPH_SIZES, prefill_tokens: int = 0
    ) -> float:
        """Capture decode graphs, with a drafter the verify graphs, and with `prefill_tokens`
        the graphs of prefill and mixed steps of up to that many tokens (CUDA only; after
        warmup). Returns seconds taken."""
        if self.device.type != "cuda":
            raise RuntimeError(f"CUDA graphs need a CUDA device, the runner is on {self.device}")
        backend = self.attention_backend
        if not isinstance(backend, PagedKernelBackend):
            # Sliding-window groups run the reference path, which no graph holds: they were
            # never replayed (_forward), so none is captured.
            log.info("no CUDA graphs: the %r attention path runs eagerly", backend.name)
            return 0.0
        options: dict[str, Any] = dict(
            max_num_reqs=self.batch.max_num_reqs,
            max_blocks_per_req=self.batch.max_blocks_per_req,
            max_model_len=self.max_model_len,
            device=self.device,
            sizes=sizes,
            latest=self.feed.latest,
            upload_stream=self.upload_stream,
        )
        graphs: DecodeGraphs
        if self.has_state_group:  # accel/hybrid_graphs.py; _forward stages [full, state]
            kinds = [g.kind for g in self.kv_groups]
            if kinds != ["full", "state"]:
                log.info("no CUDA graphs: hybrid KV groups %s (graphs take [full, state])", kinds)
                return 0.0
            graphs = HybridDecodeGraphs(
                self.model, self.kv_cache.layers, backend, block_size=self.block_size, **options
            )
        else:
            graphs = DecodeGraphs(self.model, self.kv_cache.attention_layers, backend, **options)
        seconds = graphs.capture()  # a failure: the bootstrap serves eagerly
        graphs.on_phase = self.mark_phase
        self.graphs = graphs
        spans: dict[str, Any] = dict(
            max_num_reqs=self.batch.max_num_reqs,
            max_blocks_per_req=self.batch.max_blocks_per_req,
            block_size=self.block_size,
            device=self.device,
            upload_stream=self.upload_stream,
        )
        layers = self.kv_cache.attention_layers
        if self.num_spec_tokens:
            verify = VerifyGraphs(
                self.model, layers, backend, num_spec_tokens=self.num_spec_tokens, **spans
            )
            taken = _capture(verify, "verify steps")
            if taken is not None:
                seconds += taken
                verify.on_phase = self.mark_phase
                self.verify_graphs = verify
        if self.draft_graphs and self.drafter is not None:
            seconds += self._capture_draft_loop(self.drafter, sizes)
        if self.chain is not None and self.verify_graphs is not None:
            chained = ChainGraphs(
                self.model, layers, backend, chain=self.chain, sampler=self.sampler,
                compute_logits=self.compute_logits, latest=self.feed.latest, **spans,
            )  # fmt: skip
            taken = _capture(chained, "chained verify steps")
            if taken is not None:
                seconds += taken
                chained.on_phase = self.mark_phase
                self.chain_graphs = chained
        if prefill_tokens and not needs_group_attention(self.kv_groups):  # as _forward replays
            prefill = PrefillGraphs(self.model, layers, backend, max_tokens=prefill_tokens, **spans)
            taken = _capture(prefill, "prefill and mixed steps")
            if taken is not None:
                seconds += taken
                prefill.on_phase = self.mark_phase
                self.prefill_graphs = prefill
        return seconds

    def _capture_draft_loop(self, drafter: Drafter, sizes: tuple[int, ...]) -> float:
        """Capture the draft loop of a feature head, a draft model or the DFlash draft's block
        forward (accel/draft_graphs.py)
        over a KV pool as large as the target's cache can fill (plus K per row); the seconds
        taken (0: none to capture, or it failed and proposals run eagerly)."""
        options: dict[str, Any] = dict(
            num_spec_tokens=self.num_spec_tokens,
            target_vocab_size=self.config.vocab_size,
            max_num_reqs=self.batch.max_num_reqs,
            max_model_len=self.max_model_len,
            sizes=sizes,
        )
        features, model = drafter.features, drafter.draft_model
        graphs: LoopGraphs
        if isinstance(features, FeatureDrafter):
            graphs = DraftGraphs(features, **options)
        elif isinstance(features, BlockDrafter):
            graphs = BlockGraphs(features, **options)
        elif model is not None and self.num_spec_tokens > 1:
            graphs = DraftModelGraphs(model, **options)
        else:
            return 0.0
        kv = graphs.kv
        positions = self.kv_cache.num_blocks * self.block_size + self.batch.max_num_reqs * (
            self.num_spec_tokens + kv.block_size
        )
        try:
            seconds = graphs.capture(-(-positions // kv.block_size))
        except RuntimeError:
            log.exception("CUDA graph capture of the draft loop failed: it runs eagerly")
            return 0.0
        graphs.attach()
        if features is not None:
            seconds += self._capture_observe(features, sizes)
        return seconds

    def _capture_observe(
        self, features: FeatureDrafter | BlockDrafter, sizes: tuple[int, ...]
    ) -> float:
        """Capture a feature head's `observe` forward or the DFlash draft's context writes
        (accel/observe_graphs.py) over the pool the draft loop was captured over; the seconds
        taken (0 if it failed: eager)."""
        kind = HeadObserveGraphs if isinstance(features, FeatureDrafter) else ContextGraphs
        observe: ObserveGraphs = kind(
            features,  # type: ignore[arg-type]
            num_spec_tokens=self.num_spec_tokens,
            max_num_reqs=self.batch.max_num_reqs,
            max_model_len=self.max_model_len,
            sizes=sizes,
        )
        try:
            seconds = observe.capture()
        except RuntimeError:
            log.exception("CUDA graph capture of a drafter's observe failed: it runs eagerly")
            return 0.0
        observe.attach()
        return seconds

    def _sampled_tokens(self, step: InFlightTokens, tokens: np.ndarray) -> list[SampledTokens]:
        out: SamplerOutput = step.host
        logprobs = out.logprobs.tolist() if out.logprobs is not None else None
        top_ids = out.top_token_ids.tolist() if out.top_token_ids is not None else None
        top_lp = out.top_logprobs.tolist() if out.top_logprobs is not None else None
        result = []
        # The values are ints and floats this process just made, so pydantic's per-item
        # validation is skipped on this per-step path (shared/protocol/trusted.py).
        pairs = zip(step.request_ids, tokens.tolist(), strict=True)
        for i, (request_id, token) in enumerate(pairs):
            fields: dict[str, object] = {"request_id": request_id, "token_ids": [token]}
            self.routed_experts.attach(fields, request_id)
            params: SamplingParams | None = step.params[i]
            if params is not None and params.logprobs is not None and logprobs is not None:
                fields["logprobs"] = [logprobs[i]]
                if params.logprobs and top_ids is not None and top_lp is not None:
                    fields["top_token_ids"] = top_ids[i][: params.logprobs]
                    fields["top_logprobs"] = top_lp[i][: params.logprobs]
            result.append(_sampled_tokens(**fields))
        return result

    def _bitmask(
        self, plan: StepPlan, sampled_ids: list[str]
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(bitmask [G, W] int32, index [sampled]: bitmask row of each sampled row or -1).
        (None, None) when no sampled request has a grammar this step."""
        if not plan.grammar_request_ids:
            return None, None
        groups = len(plan.grammar_request_ids)
        raw = plan.grammar_bitmask
        packed = np.frombuffer(raw[: len(raw) - len(raw) % 4], dtype="<i4")
        if len(raw) % 4 or packed.size == 0 or packed.size % groups:
            raise PlanError(
                f"grammar_bitmask has {len(raw)} bytes, not a positive multiple of 4 bytes x "
                f"{groups} grammar requests"
            )
        position = {rid: i for i, rid in enumerate(plan.grammar_request_ids)}
        index = np.array([position.get(rid, -1) for rid in sampled_ids], dtype=np.int64)
        if not (index >= 0).any():
            return None, None
        bitmask = torch.from_numpy(packed.reshape(groups, -1).copy()).to(self.device)
        return bitmask, self._to_device(index)

    def _upload_ahead(self, array: np.ndarray) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """Start uploading `array` (int64) on the upload stream; `_uploaded` makes the compute
        stream wait for it. The tensor is allocated on the upload stream and marked used on
        the compute stream, so the allocator reuses it only once both are done with it."""
        if self.upload_stream is None:
            return self._to_device(array), None
        current = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.upload_stream):
            tensor = self._to_device(array)
            tensor.record_stream(current)
            copied = torch.cuda.Event()
            copied.record()
        return tensor, copied

    def _uploaded(self, ahead: tuple[torch.Tensor, torch.cuda.Event | None]) -> torch.Tensor:
        tensor, copied = ahead
        if copied is not None:
            torch.cuda.current_stream(self.device).wait_event(copied)
        return tensor

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        # Through pinned memory on CUDA: a pageable upload would block the host.
        return stage_to_device(np.ascontiguousarray(array, dtype=np.int64), self.device)

    # -- startup ----------------------------------------------------------------------------

    @torch.inference_mode()
    def profile_run(self, num_tokens: int = 256, num_decodes: int = 8) -> float:
        """Run real forwards (one prefill of `num_tokens`, one batch of `num_decodes` decodes)
        on scratch slots, so the worker reports ready only after the model has really run.
        Writes into the KV cache: call before serving requests. Returns seconds taken."""
        started = time.perf_counter()
        num_tokens = max(1, min(num_tokens, self.max_model_len, self.kv_cache.num_slots))
        n_blocks = -(-num_tokens // self.block_size)
        table = np.arange(n_blocks, dtype=np.int64)[None, :]
        attn = self._profile_metadata(
            query_lens=np.array([num_tokens]),
            seq_lens=np.array([num_tokens]),
            block_tables=table,
            slot_mapping=np.arange(num_tokens),
        )
        positions = np.arange(num_tokens)
        ids = positions % self.config.vocab_size
        out = self.model_forward(self._to_device(ids), self._to_device(positions), attn)
        hidden, _ = split_aux_hidden(out, self.config.hidden_size)
        self.compute_logits(hidden[self._to_device(positions[-1:])])  # gathered, as _run does
        num_decodes = max(1, min(num_decodes, self.batch.max_num_reqs))
        decode_lens = np.full(num_decodes, num_tokens)
        attn = self._profile_metadata(
            query_lens=np.ones(num_decodes, dtype=np.int64),
            seq_lens=decode_lens,
            block_tables=np.repeat(table, num_decodes, axis=0),
            slot_mapping=np.full(num_decodes, num_tokens - 1),
        )
        out = self.model_forward(
            self._to_device(ids[-1:].repeat(num_decodes)), self._to_device(decode_lens - 1), attn
        )
        hidden, _ = split_aux_hidden(out, self.config.hidden_size)
        logits = self.compute_logits(hidden)
        if not bool(torch.isfinite(logits).all()):
            raise RuntimeError("profile run produced non-finite logits")
        return time.perf_counter() - started

    def _profile_metadata(
        self,
        query_lens: np.ndarray,
        seq_lens: np.ndarray,
        block_tables: np.ndarray,
        slot_mapping: np.ndarray,
    ) -> (
        AttentionMetadata
        | TritonAttentionMetadata
        | list[AttentionMetadata | TritonAttentionMetadata | StateMetadata]
    ):
        """The profile run's metadata: one for every layer, or per layer where the model has
        several groups (every group uses the same scratch table, cut to the state pool's ids
        for a state group)."""
        if not needs_group_attention(self.kv_groups):
            return self._metadata(
                query_lens=query_lens,
                seq_lens=seq_lens,
                block_tables=block_tables,
                slot_mapping=slot_mapping,
            )
        tables = np.repeat(block_tables[None], len(self.kv_groups), axis=0)
        last_state = self.kv_cache.num_state_blocks - 1  # the state pool may be the smaller
        for g, group in enumerate(self.kv_groups):
            if group.kind == "state":
                np.minimum(tables[g], last_state, out=tables[g])
        starts = seq_lens - query_lens
        positions = np.concatenate([np.arange(s, e) for s, e in zip(starts, seq_lens, strict=True)])
        rows = np.arange(len(query_lens))
        return self._group_attention(rows, query_lens, seq_lens, positions, tables)

    def warmup(self) -> float:
        """A small profile run (first-call allocations, kernel selection). A compiled forward
        is compiled here: its one graph (unbacked token count) then serves every step size,
        1-token decodes included, so no request waits for a compile. On the Triton kernels,
        every decode-attention specialization an eager step can choose is compiled too
        (decode_variants.py) and the paged prefill at each table width (prefill_variants.py),
        and on CUDA every draw the sampler can launch
        (sampling/draw_variants.py)."""
        seconds = self.profile_run(num_tokens=min(64, self.max_model_len), num_decodes=4)
        return seconds + self._compile_attention_variants() + self._compile_draws()

    @torch.inference_mode()
    def _compile_draws(self) -> float:
        """CUDA: launch each draw specialization once, over logits of this runner's LM head."""
        if self.device.type != "cuda":
            return 0.0
        started = time.perf_counter()
        dtype = next(self.model.parameters()).dtype
        rows = min(2, self.batch.max_num_reqs)
        hidden = torch.zeros(rows, self.config.hidden_size, dtype=dtype, device=self.device)
        logits = self.compute_logits(hidden)
        count, _ = precompiled(lambda: compile_draws(self.sampler, logits), self.compile_threads)
        seconds = time.perf_counter() - started
        log.info("sampler: %d draw variants compiled in %.1f s", count, seconds)
        return seconds

    def _compile_attention_variants(self) -> float:
        """CUDA, Triton backend, one full-attention group, a 16-bit cache: launch each
        decode-attention choice once, and the paged prefill kernel (the spans that continue a
        cached prefix), at the table widths of the eager steps and the graphs."""
        cache = self.kv_cache.attention_layers
        if (
            self.device.type != "cuda"
            or not isinstance(self.attention_backend, TritonPagedAttention)
            or needs_group_attention(self.kv_groups)
            or not cache
            or cache[0].element_size() != 2
        ):
            return 0.0
        # imported here: a CPU worker has no Triton (tests/unit/worker/test_imports_without_triton)
        from meshllm_kernels.attention.decode_variants import (
            compile_decode_variants,
            decode_variants,
        )
        from meshllm_kernels.attention.prefill_variants import compile_prefill_variants

        kv_heads, head_dim = cache[0].shape[-2], cache[0].shape[-1]
        variants = decode_variants(
            kv_heads, head_dim, 2, sm_count(self.device), self.batch.max_num_reqs,
            self.max_model_len,
        )  # fmt: skip
        capacity = self.batch.max_blocks_per_req
        widths = {min(capacity, WIDTH_MULTIPLE), capacity}
        dtype = next(self.model.parameters()).dtype
        heads = self.config.num_attention_heads
        started = time.perf_counter()

        def launch_each() -> None:
            compile_decode_variants(cache[0], heads, dtype, variants, widths)
            compile_prefill_variants(cache[0], heads, dtype, widths)

        # Compiled in a pool of threads first (launches there only compile), then launched for
        # real: those launches find their kernels compiled (meshllm_kernels/parallel_compile.py).
        _, pooled = precompiled(launch_each, self.compile_threads)
        seconds = time.perf_counter() - started
        log.info(
            "attention: %d decode kernel choices and the paged prefill x %d table widths "
            "compiled in %.1f s (%s)",
            len(variants),
            len(widths),
            seconds,
            "in parallel" if pooled else "one by one",
        )
        return seconds


def _capture(graphs: VerifyGraphs | PrefillGraphs, steps: str) -> float | None:
    """Capture `graphs`: the seconds taken, or None when it failed (logged; those steps then
    run eagerly)."""
    try:
        return graphs.capture()
    except RuntimeError:
        log.exception("CUDA graph capture of the %s failed: they run eagerly", steps)
        return None
