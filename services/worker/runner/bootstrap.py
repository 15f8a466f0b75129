"""Building a ready-to-serve ModelRunner from the worker's settings (no I/O beyond files).

Every rank of a tensor-parallel group builds its runner here, in the same order (the loads,
the KV block count agreed with a MIN all-reduce, the warm-up forward, the CUDA graph capture
each run the same collectives on every rank).
"""

from __future__ import annotations

import logging
import time

import torch

from services.worker.accel.cpu_compile import compile_supported
from services.worker.accel.cuda_layers import set_gemv_max_rows
from services.worker.attention.dense_prefill import set_dense_prefill
from services.worker.loader import load_model, prepare_for_device
from services.worker.models.random_init import (
    RANDOM_SCHEME,
    is_random_spec,
    load_random_model,
)
from services.worker.parallel.group import SINGLE, TensorParallel
from services.worker.runner.compile_stalls import watch_compiles
from services.worker.runner.kv_cache import (
    KVCache,
    KVCacheSizeError,
    budget_blocks,
    bytes_per_block,
    cache_budget,
    state_block_bytes,
)
from services.worker.runner.model_runner import ModelRunner
from services.worker.runner.state_pool import StatePoolPolicy, state_pool_blocks
from services.worker.runner.step_timeline import StepTimeline
from services.worker.spec import SpeculativeConfig
from shared.config import WorkerSettings
from shared.model.config import ModelConfig
from shared.model.source import ModelSource
from shared.protocol import WorkerReady

log = logging.getLogger(__name__)


def pick_device(setting: str, rank: int = 0) -> torch.device:
    """The device of tensor-parallel rank `rank`: on CUDA, one GPU per rank."""
    if setting == "auto":
        setting = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(setting)
    if device.type == "cuda" and (rank or device.index is None):
        device = torch.device("cuda", (device.index or 0) + rank)
    return device


def check_parallel_settings(settings: WorkerSettings) -> None:
    """What a tensor-parallel group cannot do is refused at start, before any rank spawns.

    Every speculative method runs: prompt lookup needs no weights, and the model drafters run
    whole on every rank, fed the target's whole hidden states, so every rank drafts alike
    (services/worker/spec/__init__.py)."""
    if settings.tp == 1:
        return
    if settings.load_format == "dummy" or is_random_spec(settings.model):
        raise ValueError("random-weight models are not sharded: MESHLLM_TP=1")


def size_pools(
    config: ModelConfig, settings: WorkerSettings, dtype: torch.dtype, device: torch.device
) -> tuple[int, int]:
    """(attention blocks, state blocks) of the KV cache budget: a hybrid model's state pool
    by state_pool.py's rule, attention the rest; (all of it, 0) without state layers."""
    budget = cache_budget(device, settings.kv_cache_bytes, settings.kv_cache_memory_fraction)
    num_state_blocks = 0
    if per_state := state_block_bytes(config, dtype):
        policy = StatePoolPolicy(
            blocks=settings.kv_state_blocks,
            share=settings.kv_state_memory_share,
            max_num_seqs=settings.max_num_seqs,
            max_num_batched_tokens=settings.max_num_batched_tokens,
        )
        per_block = bytes_per_block(config, settings.block_size, dtype)
        num_state_blocks = state_pool_blocks(
            policy, budget, settings.block_size, per_state, per_block
        )
        if num_state_blocks < (floor := policy.floor(settings.block_size)):
            log.warning(
                "the KV cache budget holds %d state blocks, fewer than the %d that %d running "
                "requests and steps of %d tokens can hold: expect preemptions, and refusals of "
                "long prompts (raise MESHLLM_KV_CACHE_BYTES)",
                num_state_blocks,
                floor,
                policy.max_num_seqs,
                policy.max_num_batched_tokens,
            )
    num_blocks = budget_blocks(
        config, settings.block_size, dtype, device, budget, num_state_blocks=num_state_blocks
    )
    return num_blocks, num_state_blocks


def build_runner(
    source: ModelSource, settings: WorkerSettings, incarnation: str, tp: TensorParallel = SINGLE
) -> tuple[ModelRunner, WorkerReady]:
    """Load weights, size the KV cache from the budget, run one real forward (readiness means
    the model has computed something), and describe the result for the scheduler. `tp`: this
    process is that rank of the worker group (what WorkerReady says is the same on every
    rank: the vocabulary, layers and KV blocks are the group's)."""
    t0 = time.monotonic()
    check_parallel_settings(settings)
    device = pick_device(settings.device, tp.rank)
    # MTP drafts with layers of the target's own checkpoint: its directory unless told.
    spec_model = settings.spec_model or (str(source.path) if settings.spec_method == "mtp" else "")
    spec = SpeculativeConfig(
        method=settings.spec_method, num_spec_tokens=settings.spec_tokens, model=spec_model
    )
    # Drafters call the target's own modules eagerly, so speculative runs stay eager.
    # The compiled CPU forward has no collectives: a sharded model runs eagerly.
    compiled = (
        settings.cpu_compile != "off" and device.type == "cpu" and not spec.enabled and tp.size == 1
    )
    random_spec = str(source.path) if is_random_spec(source.path) else ""
    if settings.load_format == "dummy":
        random_spec = f"{RANDOM_SCHEME}{source.hf_dir}"
    if random_spec:  # benchmarks: real shapes, random weights, no checkpoint (TP=1 only)
        model, config = load_random_model(
            random_spec, settings.dtype, device, settings.max_model_len, compiled
        )
    else:
        model, config = load_model(
            source, settings.dtype, device, settings.max_model_len, compiled, tp=tp
        )
    dtype = next(model.parameters()).dtype
    if compiled and (why_not := compile_supported(config, dtype, device)):
        compiled = False
        prepare_for_device(model, dtype, device)  # the eager layout load_model skipped
        level = logging.WARNING if settings.cpu_compile == "on" else logging.INFO
        log.log(level, "forward not compiled: %s", why_not)
    max_model_len = settings.max_model_len or config.max_position_embeddings
    num_blocks, num_state_blocks = size_pools(config, settings, dtype, device)
    # Ranks may hold different head counts and memory: the group holds what all ranks can.
    num_blocks = tp.min_int(num_blocks, device)
    if num_state_blocks:
        num_state_blocks = tp.min_int(num_state_blocks, device)
    kv_cache = KVCache.allocate(
        config, num_blocks, settings.block_size, dtype, device, num_state_blocks
    )
    # Block 0 is the scheduler's null block: the rest must hold one whole sequence, or the
    # context length the gateway advertises could never be served (vLLM refuses to start too).
    capacity = (kv_cache.num_blocks - 1) * kv_cache.block_size
    if capacity < max_model_len:
        raise KVCacheSizeError(
            f"the KV cache holds {capacity} tokens, fewer than one sequence of max_model_len="
            f"{max_model_len}: raise MESHLLM_KV_CACHE_BYTES (or "
            f"MESHLLM_KV_CACHE_MEMORY_FRACTION) or lower MESHLLM_MAX_MODEL_LEN"
        )
    set_gemv_max_rows(settings.gemv_max_rows)  # before the warm-up and the graph capture
    set_dense_prefill(settings.dense_prefill)
    runner = ModelRunner(
        model,
        config,
        kv_cache,
        device,
        max_model_len=max_model_len,
        worker_id=settings.instance_id,
        worker_incarnation=incarnation,
        speculative=spec,
        compiled=compiled,
        cpu_attention=settings.cpu_attention,
        device_chain=tp.size == 1
        and (
            settings.spec_device_chain == "on"
            or (settings.spec_device_chain == "auto" and device.type == "cuda")
        ),
        draft_graphs=tp.size == 1,
    )
    runner.compile_threads = settings.kernel_compile_threads or None
    if settings.step_timeline:
        runner.timeline = StepTimeline(settings.step_timeline, device)
    if device.type == "cuda":  # Triton compiles after the warm-up are logged as stalls
        runner.compile_watch = watch_compiles()
    if compiled:
        log.info("compiling the forward (torch.compile, CPU): this takes a while at start-up")
        try:
            warmup_s = runner.warmup()
        except Exception:  # a compiler failure must not stop the worker: serve eagerly
            log.exception("compiling the forward failed: the worker runs it eagerly")
            compiled, runner.compiled = False, None
            prepare_for_device(model, dtype, device)
            warmup_s = runner.warmup()
    else:
        warmup_s = runner.warmup()
    if device.type == "cuda" and not settings.enforce_eager:
        # decode steps replay graphs; the eager warm-up compiled the kernels
        try:
            warmup_s += runner.capture_cuda_graphs(prefill_tokens=settings.prefill_graph_tokens)
        except RuntimeError:  # a model whose forward cannot be captured still serves, eagerly
            log.exception("CUDA graph capture failed: decode steps run eagerly")
            runner.graphs = None
    if runner.compile_watch is not None:
        runner.compile_watch.mark_warm()
    log.info(
        "model %s loaded on %s as %s%s in %.1f s (warm-up %.2f s); KV cache: %d blocks of %d "
        "tokens, %d state blocks (%.0f MiB)",
        source.name,
        device,
        dtype,
        ", compiled" if compiled else "",
        time.monotonic() - t0,
        warmup_s,
        kv_cache.num_blocks,
        kv_cache.block_size,
        kv_cache.num_state_blocks,
        kv_cache.nbytes / 2**20,
    )
    ready = WorkerReady(
        worker_id=settings.instance_id,
        incarnation=incarnation,
        group=settings.group,
        model=source.name,
        num_kv_blocks=kv_cache.num_blocks,
        num_state_blocks=kv_cache.num_state_blocks,
        block_size=kv_cache.block_size,
        vocab_size=config.vocab_size,
        max_model_len=max_model_len,
        eos_token_ids=list(config.eos_token_ids),
        num_moe_layers=config.num_moe_layers,
        # Several groups only for sliding-window and hybrid models; one full group is
        # announced as [].
        kv_groups=config.kv_groups
        if len(config.kv_groups) > 1 or config.kv_groups[0].kind != "full"
        else [],
    )
    return runner, ready
