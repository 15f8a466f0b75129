"""Which attention implementation a step uses: the Triton kernels on CUDA, PyTorch on CPU
(with the C++ decode kernel of meshllm_kernels/attention/cpu_decode.py where it builds).

The backend is resolved once per configuration (backend_choice.py: the registry of
meshllm_kernels/attention/backends.py, asked at start-up for what the runner's forwards need,
failing closed). Each step's metadata carries it (`build_attention_metadata`): a paged kernel
backend gives `TritonAttentionMetadata`, whose kernel calls are the backend's own entry points; the
reference backend gives the reference path's `AttentionMetadata`. The model then calls
`rotary_attention`, which dispatches on the metadata's type, so every layer of a step takes the
same path and a model file never tests the device itself.

The Triton path fuses RoPE into the KV insert (meshllm_kernels.attention.kv_insert: one launch
rotates Q and K and writes K/V into the paged cache), then runs paged decode attention for the
leading single-token rows and, for the prefill spans, dense flash attention where a span has no
cached prefix (services/worker/attention/dense_prefill.py: bf16/fp16, no sliding window) and paged
prefill attention for the spans that continue a cached prefix. It needs no host synchronisation:
every length the launchers would otherwise read back (longest query, longest sequence, the split-K
factor) is computed here on the host from the plan's numpy arrays. That is what lets the same code
run inside a CUDA graph.

RoPE: the model gathers cos/sin [T, 1, rotary_dim] for the step's positions once; the Triton
path turns them into the kernel's [T, rotary_dim] table (cos halves | sin halves) once per
step (the first layer builds it, later layers reuse it) and indexes it by token index.

The kernel modules are imported where they are called (the attention kernels when the backend
is instantiated): `@triton.jit` binds to the compiler or to the interpreter (TRITON_INTERPRET)
at import time, and a CPU worker never needs Triton.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from meshllm_kernels.attention.backends import AttentionBackend, PagedKernelBackend
from meshllm_kernels.attention.cpu_decode import CpuDecodeAttention, KernelUnavailable, load
from meshllm_kernels.runtime.staged_copy import stage_to_device
from services.worker.attention.bound import LayerAttention
from services.worker.attention.dense_prefill import (
    DensePrefill,
    dense_prefill_impl,
    dense_prefill_on,
)
from services.worker.attention.reference import AttentionMetadata, paged_attention, step_lengths
from services.worker.attention.table_width import table_width
from services.worker.models.rope import apply_rotary

log = logging.getLogger(__name__)

CpuAttention = Literal["auto", "kernel", "torch"]

__all__ = [
    "CpuAttention",
    "TritonAttentionMetadata",
    "build_attention_metadata",
    "cpu_decode_kernel",
    "decode_splits",
    "prebuild_cpu_decode_kernel",
    "rotary_attention",
]


def cpu_decode_kernel(
    choice: CpuAttention, device: torch.device | str
) -> CpuDecodeAttention | None:
    """The C++ decode attention for a CPU runner: "auto" uses it where it builds (else logs
    why not and keeps PyTorch), "kernel" requires it, "torch" never uses it."""
    if choice == "torch" or torch.device(device).type != "cpu":
        return None
    try:
        return load()
    except KernelUnavailable as exc:
        if choice == "kernel":
            raise
        log.info("CPU decode attention kernel unavailable, using PyTorch: %s", exc)
        return None


def prebuild_cpu_decode_kernel(choice: CpuAttention, device: torch.device | str) -> None:
    """Build (or find) the C++ decode kernel ahead of `cpu_decode_kernel`, e.g. while the
    worker waits for its model's first conversion: on a fresh cache the two take ~20-30 s and
    ~15 s on two cores, one after the other otherwise. A failure is only reported when
    `cpu_decode_kernel` tries again."""
    if choice == "torch" or torch.device(device).type != "cpu":
        return
    with contextlib.suppress(KernelUnavailable):
        load()


def decode_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device) -> int:
    """Split-K factor of the decode kernel for this batch (any value is correct; see
    meshllm_kernels.attention.paged_decode), computed on the host so the launch needs no
    read-back."""
    from meshllm_kernels.attention.paged_decode import default_num_splits
    from meshllm_kernels.runtime.tensor_checks import sm_count

    return default_num_splits(num_seqs, num_kv_heads, max_seq_len, sm_count(device))


@dataclass
class TritonAttentionMetadata:
    """Device tensors of one step for the Triton kernels; rows [0, num_decodes) are decodes.

    Invariant: every tensor is already on the device and every int is a host value, so no
    kernel launch of the step reads anything back from the GPU.
    """

    num_tokens: int
    slot_mapping: torch.Tensor  # [T] int64; < 0 skips the token (graph padding)
    token_index: torch.Tensor  # [T] int64 = arange(T): row of each token in the RoPE table
    num_kv_heads: int
    backend: PagedKernelBackend  # resolved once per configuration (backend_choice.py)
    num_decodes: int = 0
    decode_block_tables: torch.Tensor | None = None  # [D, max_blocks] int32
    decode_seq_lens: torch.Tensor | None = None  # [D] int32
    decode_max_seq_len: int = 0
    decode_num_splits: int = 1
    prefill_block_tables: torch.Tensor | None = None  # [P, max_blocks] int32
    prefill_cu_seqlens_q: torch.Tensor | None = None  # [P + 1] int32, from 0
    prefill_seq_lens: torch.Tensor | None = None  # [P] int32
    prefill_max_seqlen_q: int = 0
    sliding_window: int | None = None  # keys q - W < k <= q (transformers' rule), as the CPU path
    # False: prefill spans are non-causal query blocks (every query sees its row's whole
    # sequence; a drafter's block, CONTRACTS "Non-causal draft blocks"), on the paged kernel
    causal: bool = True
    # Prefill spans with no cached prefix, for dense attention (None: no such span, a sliding
    # window, or disabled); the prefill_* tensors above still cover every prefill span, for
    # when no dense implementation runs on the call's device/dtype.
    dense_prefill: DensePrefill | None = None
    # Per-step memo: (the cos tensor it was built from, the RoPE table). The tensor itself is
    # kept and compared by identity: an id() could be reused by a later tensor (a graph capture
    # after its warm-up run) and hand out a table of other positions.
    rope: tuple[torch.Tensor, torch.Tensor] | None = None
    # A decode graph's feed table (in_flight.PendingFeed.latest) when the model reads the fed
    # token ids itself (input id -(row + 1) = fed_tokens[row]; DecodeGraphs sets it).
    fed_tokens: torch.Tensor | None = None

    @classmethod
    def build(
        cls,
        *,
        query_lens: np.ndarray,
        seq_lens: np.ndarray,
        block_tables: np.ndarray,
        block_size: int,
        slot_mapping: np.ndarray,
        num_kv_heads: int,
        backend: PagedKernelBackend,
        device: torch.device | str,
        sliding_window: int | None = None,
        dense_prefill: bool = True,
        dense_impl: str | None = None,
        causal: bool = True,
    ) -> TritonAttentionMetadata:
        """Same arguments as AttentionMetadata.build (decodes first), plus the model's
        kv head count (it sets the decode split factor) and the backend whose kernels the
        layers call. `dense_prefill=False` keeps every
        prefill span on the paged kernel; `dense_impl` forces a dense implementation (tests)."""
        device = torch.device(device)
        query_lens, seq_lens, num_decodes = step_lengths(query_lens, seq_lens)
        num_tokens = int(query_lens.sum())
        meta = cls(
            num_tokens=num_tokens,
            slot_mapping=_upload(np.asarray(slot_mapping, dtype=np.int64), device),
            token_index=torch.arange(num_tokens, dtype=torch.int64, device=device),
            num_kv_heads=num_kv_heads,
            backend=backend,
            num_decodes=num_decodes,
            sliding_window=sliding_window,
            causal=causal,
        )
        if num_decodes:
            lens = seq_lens[:num_decodes]
            width = table_width(lens, block_size, block_tables.shape[1])
            meta.decode_block_tables = _upload(block_tables[:num_decodes, :width], device, np.int32)
            meta.decode_seq_lens = _upload(lens, device, np.int32)
            meta.decode_max_seq_len = int(lens.max())
            span = meta.decode_max_seq_len
            meta.decode_num_splits = decode_splits(
                num_decodes, num_kv_heads, min(span, sliding_window or span), device
            )
        if num_decodes < len(query_lens):
            q_lens, lens = query_lens[num_decodes:], seq_lens[num_decodes:]
            width = table_width(lens, block_size, block_tables.shape[1])
            tables = block_tables[num_decodes:, :width]
            meta.prefill_block_tables = _upload(tables, device, np.int32)
            meta.prefill_cu_seqlens_q = _upload(
                np.concatenate(([0], np.cumsum(q_lens))), device, np.int32
            )
            meta.prefill_seq_lens = _upload(lens, device, np.int32)
            meta.prefill_max_seqlen_q = int(q_lens.max())
            if dense_prefill and dense_prefill_on() and sliding_window is None and causal:
                meta.dense_prefill = DensePrefill.build(
                    first_row=int(query_lens[:num_decodes].sum()),
                    query_lens=q_lens,
                    seq_lens=lens,
                    block_tables=block_tables[num_decodes:],
                    block_size=block_size,
                    slot_mapping=slot_mapping,
                    device=device,
                    impl=dense_impl,
                )
        return meta

    def rope_table(self, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """[T, rotary_dim] = (cos | sin) of the unique frequencies, built once per step."""
        if self.rope is not None and self.rope[0] is cos:
            return self.rope[1]
        half = cos.shape[-1] // 2
        table = torch.cat((cos[:, 0, :half], sin[:, 0, :half]), dim=-1).contiguous()
        self.rope = (cos, table)
        return table


def _upload(array: np.ndarray, device: torch.device, dtype: type = np.int64) -> torch.Tensor:
    return stage_to_device(np.ascontiguousarray(array, dtype=dtype), device)


def build_attention_metadata(
    *,
    num_kv_heads: int,
    backend: AttentionBackend,
    device: torch.device | str,
    decode_kernel: CpuDecodeAttention | None = None,
    **step: Any,
) -> AttentionMetadata | TritonAttentionMetadata:
    """The step's metadata for the path of `backend` (see the module docstring).

    `step` is AttentionMetadata.build's keyword arguments (query_lens, seq_lens, block_tables,
    block_size, slot_mapping, sliding_window), which both paths take; only the Triton path
    needs `num_kv_heads` (its decode split factor), only the CPU path `decode_kernel`.
    """
    if isinstance(backend, PagedKernelBackend):
        return TritonAttentionMetadata.build(
            num_kv_heads=num_kv_heads, backend=backend, device=device, **step
        )
    return AttentionMetadata.build(device=device, decode_kernel=decode_kernel, **step)


def rotary_attention(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    attn: AttentionMetadata | TritonAttentionMetadata | LayerAttention,
    kv_cache: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    scale: float,
) -> torch.Tensor:
    """qkv [T, (heads + 2 * kv_heads) * d] (rows [q; k; v], not yet rotated) -> attention
    output [T, heads * d], this step's K/V written into `kv_cache` first."""
    tokens = qkv.shape[0]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    v = qkv[:, q_size + kv_size :].view(tokens, num_kv_heads, head_dim)
    if not isinstance(attn, TritonAttentionMetadata):
        # Rotate q and k together: one elementwise pass over [T, heads + kv_heads, d].
        qk = qkv[:, : q_size + kv_size].view(tokens, -1, head_dim)
        qk = apply_rotary(qk, cos, sin)
        q, k = qk[:, :num_heads], qk[:, num_heads:]
        if isinstance(attn, LayerAttention):  # inside a compiled forward (cpu_compile.py)
            return attn.attend(q, k, v, kv_cache, scale)
        return paged_attention(q, k, v, kv_cache, attn, scale)
    from meshllm_kernels.attention.kv_insert import insert_qkv

    q = qkv[:, :q_size].view(tokens, num_heads, head_dim)
    k = qkv[:, q_size : q_size + kv_size].view(tokens, num_kv_heads, head_dim)
    q = insert_qkv(
        q, k, v, kv_cache, attn.slot_mapping, attn.token_index, attn.rope_table(cos, sin)
    )
    return triton_attention(q, kv_cache, attn, scale).view(tokens, q_size)


def triton_attention(
    q: torch.Tensor, kv_cache: torch.Tensor, attn: TritonAttentionMetadata, scale: float
) -> torch.Tensor:
    """Rotated q [T, heads, d] over the paged cache (this step's K/V already inserted), through
    the step's backend's kernels."""
    d = attn.num_decodes
    split = attn.dense_prefill
    impl = _dense_impl(split, q, kv_cache) if d < q.shape[0] else None
    if impl is not None and split is not None and d == 0 and split.paged is None:
        return split.attend(impl, q, kv_cache, scale)  # every row is a fresh prefill row
    out = torch.empty_like(q)
    if d:
        attn.backend.decode(
            q[:d], kv_cache, attn.decode_block_tables, attn.decode_seq_lens,
            sliding_window=attn.sliding_window, sm_scale=scale,
            num_splits=attn.decode_num_splits, max_seq_len=attn.decode_max_seq_len, out=out[:d],
        )  # fmt: skip
    if impl is not None and split is not None:
        out[split.rows] = split.attend(impl, q[split.rows], kv_cache, scale)
        if split.paged is not None:
            _paged_spans(q, kv_cache, attn, split, scale, out)
    elif d < q.shape[0]:
        attn.backend.prefill(
            q[d:], kv_cache, attn.prefill_block_tables, attn.prefill_cu_seqlens_q,
            attn.prefill_seq_lens, causal=attn.causal, sliding_window=attn.sliding_window,
            sm_scale=scale,
            max_seqlen_q=attn.prefill_max_seqlen_q, out=out[d:],
        )  # fmt: skip
    return out


def _dense_impl(split: DensePrefill | None, q: torch.Tensor, kv_cache: torch.Tensor) -> str | None:
    """The dense implementation for this call, or None (paged kernel for every span): the
    cache must hold the model's own dtype (an fp8 cache would need dequantizing first)."""
    if split is None or kv_cache.dtype != q.dtype:
        return None
    if split.impl is not None:
        return split.impl
    heads, kv_heads, head_dim = q.shape[1], kv_cache.shape[3], q.shape[2]
    return dense_prefill_impl(q.device, q.dtype, heads, kv_heads, head_dim)


def _paged_spans(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    attn: TritonAttentionMetadata,
    split: DensePrefill,
    scale: float,
    out: torch.Tensor,
) -> None:
    """The prefill spans that continue a cached prefix, through the paged kernel."""
    p = split.paged
    assert p is not None
    contiguous = isinstance(p.rows, slice)
    result = attn.backend.prefill(
        q[p.rows], kv_cache, p.block_tables, p.cu_seqlens_q, p.seq_lens, causal=True,
        sliding_window=attn.sliding_window, sm_scale=scale, max_seqlen_q=p.max_seqlen_q,
        out=out[p.rows] if contiguous else None,
    )  # fmt: skip
    if not contiguous:
        out[p.rows] = result
