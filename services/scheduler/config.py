"""The scheduler core's configuration: the deployment's settings merged with what the worker
announced (its KV capacity and block size are authoritative: they describe real tensors)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from services.scheduler.kv.kv_cache_spec import (
    FullAttentionSpec,
    KVCacheGroup,
    KVCacheSpec,
    RingSpec,
    SlidingWindowSpec,
    StateSpec,
)
from services.scheduler.spec.lookahead import lookahead_of
from services.scheduler.structured_output.reasoning import ReasoningConfig
from shared.config import SchedulerSettings, SchedulingPolicy
from shared.kv.groups import KVGroupSpec
from shared.protocol import WorkerReady


class SchedulerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    block_size: int = Field(default=16, ge=1)
    # Pool size, including the reserved null block 0.
    num_gpu_blocks: int = Field(default=1024, ge=2)
    # The state pool of a hybrid model's state groups, including its own null block 0
    # (WorkerReady.num_state_blocks). 0 = no state pool: state groups, if any, draw from the
    # attention pool (a worker that announced none keeps both kinds under one id space).
    num_state_blocks: int = Field(default=0, ge=0)
    max_num_seqs: int = Field(default=64, ge=1)  # running requests at most
    # Tokens computed per step, all requests together (the chunked-prefill budget).
    max_num_batched_tokens: int = Field(default=2048, ge=1)
    # One request's tokens per step at most (0 = no cap): vLLM's long_prefill_token_threshold.
    long_prefill_token_threshold: int = Field(default=0, ge=0)
    max_model_len: int = Field(default=2048, ge=1)  # prompt + output tokens at most
    enable_prefix_caching: bool = True
    eos_token_ids: list[int] = Field(default_factory=list)
    # The model's vocabulary (WorkerReady): a request with a token id outside it is refused.
    # 0 = unknown (only negative ids are refused).
    vocab_size: int = Field(default=0, ge=0)
    # A request whose steps failed this many times finishes with "error" instead of recomputing
    # forever (a request that crashes the worker would otherwise loop).
    max_step_failures: int = Field(default=3, ge=1)
    # Empty = one full-attention group at `block_size`.
    kv_cache_groups: list[KVCacheGroup] = Field(default_factory=list)
    # Structured outputs: where reasoning ends (the grammar applies after it).
    reasoning: ReasoningConfig = Field(default_factory=ReasoningConfig)
    # Speculative decoding: at most this many of the worker's drafts verified per request and
    # step (lookahead slots); 0 = off (services/scheduler/spec).
    num_spec_tokens: int = Field(default=0, ge=0)
    # The worker verifies its own drafts in lookahead slots (StepPlan.spec_lookahead) for
    # requests without a grammar, so verify steps are planned ahead like plain decoding (on
    # with asynchronous scheduling); off: every request's drafts come back in its result and go
    # out in the next plan (one step at a time).
    spec_drafts_on_worker: bool = False
    # The one prefill-lookahead number (services.scheduler.spec.lookahead): P/D's handoff
    # point and the tokens a sliding-window group retains beyond its window.
    lookahead_tokens: int = Field(default=0, ge=0)
    scheduling_policy: SchedulingPolicy = "fcfs"

    @model_validator(mode="after")
    def _default_groups(self) -> SchedulerConfig:
        if not self.kv_cache_groups:
            self.kv_cache_groups = [
                KVCacheGroup(spec=FullAttentionSpec(block_size=self.block_size))
            ]
        for group in self.kv_cache_groups:
            if group.spec.block_size != self.block_size:
                raise ValueError(
                    f"KV cache group block size {group.spec.block_size} != block_size "
                    f"{self.block_size}"
                )
        if self.num_spec_tokens and any(isinstance(g.spec, RingSpec) for g in self.kv_cache_groups):
            # Drafts written into a ring overwrite the oldest slots in place; a rejected draft
            # cannot give them back, so a rollback would leave positions the next token reads
            # overwritten (a ring has no lookahead slots to retain them).
            raise ValueError("speculative decoding with a ring-buffer KV cache group")
        if self.num_state_blocks:
            if self.num_state_blocks < 2:
                raise ValueError("a state pool needs at least 2 blocks (1 is the null block)")
            if not any(isinstance(g.spec, StateSpec) for g in self.kv_cache_groups):
                raise ValueError(f"num_state_blocks={self.num_state_blocks} without a state group")
        return self

    @classmethod
    def from_worker(cls, settings: SchedulerSettings, ready: WorkerReady) -> SchedulerConfig:
        """Settings for policy (batch limits, prefix caching, the queue), the worker for
        capacity.

        `settings.max_model_len` may only shrink the worker's context length (0 = the worker's).
        """
        # A prefill/decode role meeting a hybrid model's state group is served: P/D hands the
        # state group over through the tier (services/scheduler/offload/connector.py,
        # `transfer_state`) while the tier's prefix cache stays attention-only.
        max_model_len = ready.max_model_len
        if 0 < settings.max_model_len < max_model_len:
            max_model_len = settings.max_model_len
        return cls(
            block_size=ready.block_size,
            num_gpu_blocks=ready.num_kv_blocks,
            num_state_blocks=ready.num_state_blocks,
            max_num_seqs=settings.max_num_seqs,
            max_num_batched_tokens=settings.max_num_batched_tokens,
            long_prefill_token_threshold=settings.long_prefill_token_threshold,
            max_model_len=max_model_len,
            enable_prefix_caching=settings.enable_prefix_caching,
            eos_token_ids=list(ready.eos_token_ids),
            vocab_size=ready.vocab_size,
            num_spec_tokens=settings.spec_tokens if settings.spec_method else 0,
            spec_drafts_on_worker=settings.async_scheduling and settings.spec_drafts_on_worker,
            lookahead_tokens=lookahead_of(settings),
            scheduling_policy=settings.scheduling_policy,
            kv_cache_groups=kv_cache_groups_from(ready.kv_groups, ready.block_size),
            reasoning=ReasoningConfig(
                end_token_ids=tuple(settings.reasoning_end_token_ids),
                start_token_ids=tuple(settings.reasoning_start_token_ids),
                enable_in_reasoning=settings.structured_outputs_enable_in_reasoning,
            ),
        )


def kv_cache_groups_from(groups: list[KVGroupSpec], block_size: int) -> list[KVCacheGroup]:
    """The scheduler's groups for the worker's announced ones, in the same order (plan block
    lists are indexed by it). Empty stays empty: the config then makes one full group."""
    out: list[KVCacheGroup] = []
    for group in groups:
        layers = tuple(str(i) for i in group.layer_indices)
        spec: KVCacheSpec
        if group.kind == "full":
            spec = FullAttentionSpec(block_size=block_size)
        elif group.kind == "state":
            spec = StateSpec(block_size=block_size)
        elif group.kind == "ring":
            assert group.ring_size is not None  # KVGroupSpec validates it
            spec = RingSpec(block_size=block_size, ring_size=group.ring_size)
        else:
            assert group.sliding_window is not None  # KVGroupSpec validates it
            spec = SlidingWindowSpec(block_size=block_size, sliding_window=group.sliding_window)
        out.append(KVCacheGroup(spec=spec, layer_names=layers))  # type: ignore[arg-type]
    return out
