"""Paged decode attention on CPU: a C++ kernel (meshllm_kernels/attention/cpu/decode_attention.cpp)
that reads the KV cache in place, beside the PyTorch reference path it replaces for decode rows
(services/worker/attention/reference.py: gather the blocks, mask, SDPA).

Why a kernel here: at the sizes a CPU worker serves (a few sequences of a few hundred tokens)
the reference path spends a decode layer on op dispatch and block copies, not arithmetic, so a
kernel that reads the blocks where they lie is faster at every length a CPU worker serves.

The library is compiled once per machine with the system C++ compiler (`-O3 -march=native
-fopenmp`; meshllm_kernels/runtime/cpu_library.py) and loaded with ctypes. Its OpenMP loop runs
in torch's own thread team: the library's `libgomp.so.1` resolves to the one torch already
loaded, so `torch.set_num_threads` sets its width and no second team competes for the cores.

No compiler, or a build that fails: `load()` raises KernelUnavailable with the reason, and the
worker keeps the reference path.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from meshllm_kernels.runtime.cpu_library import KernelUnavailable, load_library
from meshllm_kernels.runtime.tensor_checks import check_shape, check_tensor

__all__ = ["CpuDecodeAttention", "DecodeStep", "KernelUnavailable", "load", "supports"]

SOURCE = Path(__file__).parent / "cpu" / "decode_attention.cpp"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")
DTYPES = {torch.bfloat16: "bf16", torch.float32: "f32"}
VECTOR_WIDTH = 16  # head_dim must be a multiple (the kernel's vectors are 16 or 8 floats)
MAX_HEAD_DIM = 128

_P = ctypes.c_void_p
_I = ctypes.c_int64
_ARGTYPES = [_P, _I, _P, _P, _I, _P, _I, _I, _P, _I, _P, _I, _P, _I, _I, _I, _I, ctypes.c_float]
_ARGTYPES += [_P, _I]


def supports(q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether a layer with these tensors can take the kernel (else the reference path)."""
    return (
        q.device.type == "cpu"
        and q.dtype in DTYPES
        and kv_cache.dtype == q.dtype
        and kv_cache.is_contiguous()
        and q.shape[-1] % VECTOR_WIDTH == 0
        and q.shape[-1] <= MAX_HEAD_DIM
    )


class CpuDecodeAttention:
    """The loaded library. `step(...)` checks one step's metadata once and returns the launcher
    its layers call; `__call__` does both at once."""

    supports = staticmethod(supports)

    def __init__(self, library: ctypes.CDLL, path: Path) -> None:
        self.path = path
        self.functions = {}
        for dtype, suffix in DTYPES.items():
            fn = getattr(library, f"meshllm_decode_attention_{suffix}")
            fn.argtypes = _ARGTYPES
            fn.restype = ctypes.c_int
            self.functions[dtype] = fn

    def step(
        self, slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor
    ) -> DecodeStep:
        return DecodeStep(self, slot_mapping, block_tables, seq_lens)

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """See DecodeStep.__call__."""
        return self.step(slot_mapping, block_tables, seq_lens)(q, k, v, kv_cache, scale)


class DecodeStep:
    """One step's decode metadata, checked once; called once per layer.

    The C++ code trusts every index it is given, so nothing reaches it unchecked: the metadata
    here (dtypes, shapes, and every slot, block id and length in range of the cache), and each
    layer's q/k/v/cache geometry, which is checked in full on the first layer and compared
    with that one on the others (the layers of a step share it).
    """

    def __init__(
        self,
        kernel: CpuDecodeAttention,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
    ) -> None:
        for name, t in (("slot_mapping", slot_mapping), ("seq_lens", seq_lens)):
            check_tensor(name, t, dtypes=(torch.int64,), ndim=1, contiguous=True)
        check_tensor("block_tables", block_tables, dtypes=(torch.int64,), ndim=2)
        if block_tables.shape[0] != seq_lens.shape[0]:
            raise ValueError(
                f"{seq_lens.shape[0]} sequence lengths for {block_tables.shape[0]} block tables"
            )
        self.functions = kernel.functions
        self.slot_mapping = slot_mapping
        self.block_tables = block_tables.contiguous()
        self.seq_lens = seq_lens
        self.num_decodes = seq_lens.shape[0]
        self._ranges = (
            _span(slot_mapping),
            _span(self.block_tables),
            _span(seq_lens),
        )
        self._checked: tuple[object, ...] | None = None

    supports = staticmethod(supports)

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """Write k/v [T, kv_heads, d] at the step's slots, then attend the first n rows of
        q [T, heads, d] (n = len(seq_lens)) over their sequences' cached keys (block tables
        [n, >= ceil(max(seq_lens) / block_size)]). Returns [n, heads * d]."""
        geometry = (
            q.dtype,
            q.shape,
            q.stride(),
            k.shape,
            k.stride(),
            v.shape,
            v.stride(),
            kv_cache.dtype,
            kv_cache.shape,
            kv_cache.is_contiguous(),
        )
        if geometry != self._checked:
            self._check(q, k, v, kv_cache)
            self._checked = geometry
        tokens, heads, head_dim = q.shape
        _, num_blocks, block_size, kv_heads, _ = kv_cache.shape
        q, k, v = (_rows(t) for t in (q, k, v))
        if k.stride(0) != v.stride(0):
            k, v = k.contiguous(), v.contiguous()
        out = q.new_empty(self.num_decodes, heads * head_dim)
        status = self.functions[q.dtype](
            q.data_ptr(),
            q.stride(0),
            k.data_ptr(),
            v.data_ptr(),
            k.stride(0),
            kv_cache.data_ptr(),
            num_blocks,
            block_size,
            self.slot_mapping.data_ptr(),
            tokens,
            self.block_tables.data_ptr(),
            self.block_tables.stride(0),
            self.seq_lens.data_ptr(),
            self.num_decodes,
            heads,
            kv_heads,
            head_dim,
            scale,
            out.data_ptr(),
            out.stride(0),
        )
        if status != 0:
            raise RuntimeError(f"cpu decode attention failed (status {status})")
        return out

    def _check(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor
    ) -> None:
        q = check_tensor("q", q, dtypes=tuple(DTYPES), ndim=3, device=torch.device("cpu"))
        tokens, heads, head_dim = q.shape
        check_tensor("kv_cache", kv_cache, dtypes=(q.dtype,), ndim=5, contiguous=True)
        _, num_blocks, block_size, kv_heads, cache_dim = kv_cache.shape
        if cache_dim != head_dim:
            raise ValueError(f"kv_cache head_dim {cache_dim} differs from q's {head_dim}")
        if head_dim % VECTOR_WIDTH or head_dim > MAX_HEAD_DIM or kv_heads == 0 or heads % kv_heads:
            raise ValueError(
                f"unsupported heads: {heads} query / {kv_heads} KV heads of dim {head_dim} "
                f"(head_dim must be a multiple of {VECTOR_WIDTH} up to {MAX_HEAD_DIM}, heads a "
                "multiple of KV heads)"
            )
        for name, t in (("k", k), ("v", v)):
            check_tensor(name, t, dtypes=(q.dtype,), ndim=3)
            check_shape(name, t, (tokens, kv_heads, head_dim))
        check_shape("slot_mapping", self.slot_mapping, (tokens,))
        if self.num_decodes > tokens:
            raise ValueError(f"{self.num_decodes} sequence lengths for {tokens} query rows")
        slots, blocks, lens = self._ranges
        width = self.block_tables.shape[1]
        if slots and not 0 <= slots[0] <= slots[1] < num_blocks * block_size:
            raise ValueError(f"slot_mapping {slots} outside the cache's {num_blocks} blocks")
        if blocks and not 0 <= blocks[0] <= blocks[1] < num_blocks:
            raise ValueError(f"block_tables {blocks} outside the cache's {num_blocks} blocks")
        if lens and not 1 <= lens[0] <= lens[1] <= width * block_size:
            raise ValueError(
                f"seq_lens {lens} outside 1..{width * block_size} (tables of {width} blocks)"
            )


def _span(t: torch.Tensor) -> tuple[int, int] | tuple[()]:
    """(min, max) of an index tensor, () when empty."""
    if t.numel() == 0:
        return ()
    return int(t.min()), int(t.max())


def _rows(t: torch.Tensor) -> torch.Tensor:
    """`t` [T, heads, d] with heads contiguous inside a row (any row stride), else a copy."""
    if t.stride(2) == 1 and t.stride(1) == t.shape[2]:
        return t
    return t.contiguous()


@functools.cache
def load(cache_dir: Path | None = None) -> CpuDecodeAttention:
    """Build (once per machine) and load the kernel; KernelUnavailable says why not."""
    library, path = load_library(SOURCE, FLAGS, cache_dir)
    return CpuDecodeAttention(library, path)
