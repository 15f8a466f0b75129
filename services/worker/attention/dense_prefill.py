"""Prefill spans with no cached prefix, on CUDA: dense causal attention over the span itself.

A span whose context starts empty (seq_len == query_len: a fresh prompt, or its first chunk)
attends only to its own tokens, so it needs no paged reads: the step's K/V rows of those spans
are gathered from the cache once (after the fused RoPE insert wrote them, so attention sees the
exact cached bytes) and one variable-length flash-attention call covers every such span. Spans
that continue a cached prefix keep the paged Triton kernel (attention_select).

Implementations, each probed once per (device, dtype, heads, kv heads, head dim) on a small
input against a float32 reference; "auto" (settings.dense_prefill) takes the first that passed:
- `flash-varlen`: `torch.ops.aten._flash_attention_forward` with cumulative lengths (the
  flash-attention 2 kernel behind SDPA; grouped KV heads natively), one call for every span.
  Its positional signature is stable across torch 2.4-2.13, unlike the Python wrappers
  (torch.nn.attention.varlen has changed its keyword arguments in every release since 2.9).
- `sdpa`: `scaled_dot_product_attention(is_causal=True, enable_gqa=True)`, one call per run of
  consecutive spans of one length, batched as [spans, heads, length, d] views (also what the
  CPU interpreter tests run). On the H100 torch runs cuDNN's attention here: 2.4x flash-varlen
  on 16 x 512 causal spans, 1.7-1.8x on 2 x 4096 and 1 x 8192, 0.6x over 8 lengths (eight
  calls). But cuDNN builds a plan on the host at the first call of every new (spans, length):
  43-153 ms, a serving step held, for each prompt length a server meets. So only by name, for
  workloads of a few fixed shapes (bench/RESULTS.md).
- none: the Triton kernel keeps every span (`dense_prefill_impl` returns None).
`DENSE_PREFILL_CHOICES` records what each probe passed, so a benchmark can report it.
(`torch.ops.aten._cudnn_attention_forward` with cumulative lengths, cuDNN's ragged path, agrees
with the reference but took 79-81 ms a call on the H100: a new plan every call.)

Invariant: the host computes every length and index here from the plan's numpy arrays, so
launching the dense path needs no read-back from the GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from meshllm_kernels.runtime.staged_copy import stage_to_device
from services.worker.attention.table_width import table_width

__all__ = [
    "DENSE_PREFILL_CHOICES",
    "DENSE_PREFILL_DTYPES",
    "DensePrefill",
    "dense_attention",
    "dense_prefill_impl",
    "dense_prefill_on",
    "set_dense_prefill",
    "span_runs",
    "split_prefill_spans",
]

IMPLS = ("flash-varlen", "sdpa")
DENSE_PREFILL_DTYPES = (torch.bfloat16, torch.float16)  # flash-attention's dtypes
DENSE_PREFILL_CHOICES: dict[tuple[str, str, int, int, int], tuple[str, ...]] = {}


def split_prefill_spans(query_lens: np.ndarray, seq_lens: np.ndarray) -> np.ndarray:
    """Boolean mask over the prefill spans: True where the span has no cached prefix."""
    return np.asarray(seq_lens) == np.asarray(query_lens)


def _span_rows(starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    return np.concatenate([np.arange(s, s + n) for s, n in zip(starts, lens, strict=True)])


def _device_rows(rows: np.ndarray, device: torch.device) -> slice | torch.Tensor:
    """Rows as a slice when contiguous (q and out then need no gather), else an index."""
    if np.array_equal(rows, np.arange(rows[0], rows[0] + rows.size)):
        return slice(int(rows[0]), int(rows[0] + rows.size))
    return _upload(rows, device, np.int64)


def _upload(array: np.ndarray, device: torch.device, dtype: type) -> torch.Tensor:
    return stage_to_device(np.ascontiguousarray(array, dtype=dtype), device)


@dataclass
class PagedSpans:
    """The prefill spans left to the paged Triton kernel (they continue a cached prefix)."""

    rows: slice | torch.Tensor  # token rows of the step
    block_tables: torch.Tensor  # [P, width] int32
    cu_seqlens_q: torch.Tensor  # [P + 1] int32
    seq_lens: torch.Tensor  # [P] int32
    max_seqlen_q: int


@dataclass
class DensePrefill:
    """The split of one step's prefill spans: the fresh ones (dense attention) and the paged
    rest (None when every span is fresh).

    `impl` None: chosen at the first call by `dense_prefill_impl` for the call's dtype and
    heads (the metadata does not know them); a name forces that implementation (tests)."""

    rows: slice | torch.Tensor  # token rows of the fresh spans
    kv_slots: torch.Tensor  # [N] int64: cache slot (block * block_size + offset) of each
    cu_seqlens: torch.Tensor  # [F + 1] int32 from 0
    span_lens: list[int]
    max_len: int
    paged: PagedSpans | None
    impl: str | None = None

    @classmethod
    def build(
        cls,
        *,
        first_row: int,
        query_lens: np.ndarray,
        seq_lens: np.ndarray,
        block_tables: np.ndarray,
        block_size: int,
        slot_mapping: np.ndarray,
        device: torch.device,
        impl: str | None = None,
    ) -> DensePrefill | None:
        """Split the prefill spans (arrays over them alone; their rows start at `first_row`
        of the step); None when no span is fresh."""
        fresh = split_prefill_spans(query_lens, seq_lens)
        if not fresh.any():
            return None
        starts = first_row + np.concatenate(([0], np.cumsum(query_lens)[:-1]))
        f_lens = query_lens[fresh]
        f_rows = _span_rows(starts[fresh], f_lens)
        f_slots = np.asarray(slot_mapping, dtype=np.int64)[f_rows]
        paged = None
        if not fresh.all():
            rest = ~fresh
            q_lens, lens = query_lens[rest], seq_lens[rest]
            width = table_width(lens, block_size, block_tables.shape[1])
            paged = PagedSpans(
                rows=_device_rows(_span_rows(starts[rest], q_lens), device),
                block_tables=_upload(block_tables[rest, :width], device, np.int32),
                cu_seqlens_q=_upload(np.concatenate(([0], np.cumsum(q_lens))), device, np.int32),
                seq_lens=_upload(lens, device, np.int32),
                max_seqlen_q=int(q_lens.max()),
            )
        return cls(
            rows=_device_rows(f_rows, device),
            kv_slots=_upload(f_slots, device, np.int64),
            cu_seqlens=_upload(np.concatenate(([0], np.cumsum(f_lens))), device, np.int32),
            span_lens=[int(n) for n in f_lens],
            max_len=int(f_lens.max()),
            paged=paged,
            impl=impl,
        )

    def attend(
        self, impl: str, q: torch.Tensor, kv_cache: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """Rotated q [N, heads, d] of the fresh rows -> their attention output [N, heads, d].

        K/V are the cache rows this step's insert just wrote: one `index_select` of whole
        token rows for both, over the cache viewed as [2, slots, kv_heads, d] (a view: it
        raises rather than copy the cache). Indexing blocks and offsets as two tensors ran
        PyTorch's generic index kernel instead: 118 us against 66 us a layer for an
        8192-token chunk of Llama-3-8B on the H100 (`bench.gpu.decode_profile`)."""
        two, _, _, kv_heads, head_dim = kv_cache.shape
        kv = kv_cache.view(two, -1, kv_heads, head_dim).index_select(1, self.kv_slots)
        return dense_attention(
            impl, q, kv[0], kv[1], self.cu_seqlens, self.span_lens, self.max_len, scale
        )


def dense_attention(
    impl: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    span_lens: list[int],
    max_len: int,
    scale: float,
) -> torch.Tensor:
    """Causal attention of packed spans: q [N, Hq, D], k/v [N, Hkv, D] -> [N, Hq, D]."""
    if impl == "flash-varlen":
        out = torch.ops.aten._flash_attention_forward(
            q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, 0.0, True, False, scale=scale
        )[0]
        return out
    if impl == "sdpa":
        runs = span_runs(span_lens)
        heads, head_dim = q.shape[1], q.shape[2]
        outs = []
        for first, count, n in runs:
            q_, k_, v_ = (_batched(t, first, count, n) for t in (q, k, v))
            out = F.scaled_dot_product_attention(
                q_, k_, v_, is_causal=True, scale=scale, enable_gqa=True
            )
            outs.append(out.transpose(1, 2).reshape(count * n, heads, head_dim))
        return outs[0] if len(outs) == 1 else torch.cat(outs)
    raise ValueError(f"unknown dense prefill implementation {impl!r}; known: {IMPLS}")


def _batched(t: torch.Tensor, first: int, count: int, n: int) -> torch.Tensor:
    """Rows [first, first + count * n) of packed [N, heads, d] as [count, heads, n, d] (a
    view)."""
    return t[first : first + count * n].view(count, n, t.shape[1], t.shape[2]).transpose(1, 2)


def span_runs(span_lens: list[int]) -> list[tuple[int, int, int]]:
    """Consecutive spans of one length: (first row, spans, length) of each run."""
    runs: list[tuple[int, int, int]] = []
    start = 0
    for n in span_lens:
        if runs and runs[-1][2] == n:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1, n)
        else:
            runs.append((start, 1, n))
        start += n
    return runs


def reference_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, span_lens: list[int], scale: float
) -> torch.Tensor:
    """float32 causal attention per span, grouped heads expanded (the probe's reference)."""
    group = q.shape[1] // k.shape[1]
    out, start = [], 0
    for n in span_lens:
        qs = q[start : start + n].float().transpose(0, 1)
        ks = k[start : start + n].float().repeat_interleave(group, 1).transpose(0, 1)
        vs = v[start : start + n].float().repeat_interleave(group, 1).transpose(0, 1)
        scores = (qs @ ks.transpose(1, 2)) * scale
        mask = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
        out.append((scores.softmax(-1) @ vs).transpose(0, 1))
        start += n
    return torch.cat(out)


def _probe(
    impl: str, device: torch.device, dtype: torch.dtype, heads: int, kv: int, d: int
) -> bool:
    """Does `impl` run here and agree with the float32 reference on two short spans?"""
    gen = torch.Generator(device="cpu").manual_seed(0)
    lens = [5, 19]
    n = sum(lens)
    q, k, v = (torch.randn(n, h, d, generator=gen).to(device, dtype) for h in (heads, kv, kv))
    cu = torch.tensor([0, lens[0], n], dtype=torch.int32, device=device)
    scale = d**-0.5
    try:
        out = dense_attention(impl, q, k, v, cu, lens, max(lens), scale)
    except (RuntimeError, TypeError, NotImplementedError, AttributeError):
        return False
    ref = reference_attention(q, k, v, lens, scale)
    err = float((out.float() - ref).norm() / ref.norm())
    return out.shape == q.shape and err < (2e-2 if dtype != torch.float32 else 1e-4)


DENSE_PREFILL_POLICIES = ("auto", *IMPLS, "off")
_policy = "auto"


def set_dense_prefill(policy: str) -> None:
    """settings.dense_prefill: "auto" (the first implementation that passed its probe), one's
    name (that one wherever its probe passed, else the paged kernel), or "off" (the paged
    kernel always)."""
    global _policy
    if policy not in DENSE_PREFILL_POLICIES:
        raise ValueError(f"dense_prefill must be one of {DENSE_PREFILL_POLICIES}, got {policy!r}")
    _policy = policy


def dense_prefill_on() -> bool:
    """False when settings.dense_prefill is "off": no step builds the dense split."""
    return _policy != "off"


def dense_prefill_impl(
    device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int
) -> str | None:
    """The implementation settings.dense_prefill asks for where its probe passed: "auto" the
    first of IMPLS that runs and agrees with the reference (None: none does, the device is not
    CUDA, the dtype not flash-attention's, or the setting is "off"). Probed once per shape."""
    if device.type != "cuda" or dtype not in DENSE_PREFILL_DTYPES or _policy == "off":
        return None
    key = (str(device), str(dtype), heads, kv_heads, head_dim)
    if key not in DENSE_PREFILL_CHOICES:
        DENSE_PREFILL_CHOICES[key] = tuple(
            i for i in IMPLS if _probe(i, device, dtype, heads, kv_heads, head_dim)
        )
    passed = DENSE_PREFILL_CHOICES[key]
    if _policy != "auto":
        return _policy if _policy in passed else None
    return passed[0] if passed else None
