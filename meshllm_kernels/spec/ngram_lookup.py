"""The n-gram draft search in C++ (meshllm_kernels/spec/ngram_lookup.cpp), for
services/worker/spec/ngram.py: the same drafts as its NumPy path for a whole batch in one call.
Built and loaded as meshllm_kernels/runtime/cpu_library.py says; KernelUnavailable (no
compiler) leaves the NumPy path in use.

The C++ code trusts its indices, so every row and length is checked here against the token
array's shape before the call.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import numpy as np

from meshllm_kernels.runtime.cpu_library import load_library

SOURCE = Path(__file__).with_suffix(".cpp")
FLAGS = ("-O3", "-march=native", "-shared", "-fPIC")
_P = ctypes.c_void_p
_I = ctypes.c_int64


class NgramLookup:
    def __init__(self, library: ctypes.CDLL, path: Path) -> None:
        self.path = path
        self._fn = library.meshllm_ngram_lookup
        self._fn.argtypes = [_P, _I, _P, _P, _P, _I, _I, _I, _P, _P]
        self._fn.restype = ctypes.c_int

    def __call__(
        self,
        token_ids: np.ndarray,
        rows: np.ndarray,
        lengths: np.ndarray,
        ks: np.ndarray,
        min_n: int,
        max_n: int,
    ) -> tuple[np.ndarray, np.ndarray]:
        """(start, count) of each row's drafts in its row of `token_ids` [R, W] int32 (count
        0: none)."""
        if token_ids.dtype != np.int32 or token_ids.ndim != 2:
            raise ValueError(
                f"token_ids must be int32 [R, W], not {token_ids.dtype} {token_ids.shape}"
            )
        # a row's tokens side by side (a one-column or empty array has any column stride)
        if (token_ids.shape[1] > 1 and token_ids.strides[1] != 4) or token_ids.strides[0] % 4:
            raise ValueError(
                f"token_ids must hold each row's tokens side by side: {token_ids.strides}"
            )
        rows, lengths, ks = (np.ascontiguousarray(a, dtype=np.int64) for a in (rows, lengths, ks))
        n = len(rows)
        if not len(lengths) == len(ks) == n:
            raise ValueError(f"{n} rows, {len(lengths)} lengths, {len(ks)} ks")
        if n:
            rows_ok = rows.min() >= 0 and rows.max() < token_ids.shape[0]
            if not (rows_ok and lengths.min() >= 0 and lengths.max() <= token_ids.shape[1]):
                raise ValueError(f"rows or lengths outside token_ids {token_ids.shape}")
        starts = np.zeros(n, dtype=np.int64)
        counts = np.zeros(n, dtype=np.int64)
        self._fn(
            token_ids.ctypes.data,
            token_ids.strides[0] // 4,
            rows.ctypes.data,
            lengths.ctypes.data,
            ks.ctypes.data,
            n,
            min_n,
            max_n,
            starts.ctypes.data,
            counts.ctypes.data,
        )
        return starts, counts


@functools.cache
def load(cache_dir: Path | None = None) -> NgramLookup:
    """Build (once per machine) and load the search; KernelUnavailable says why not."""
    return NgramLookup(*load_library(SOURCE, FLAGS, cache_dir))
