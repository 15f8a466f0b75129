"""How many columns of the block tables an eager step uploads for the Triton kernels.

Triton specializes a kernel on each integer argument by whether it is 1 or a multiple of 16,
and the kernels take the table's row stride (its width). A width of exactly the blocks the
step's longest sequence uses would compile the kernels again whenever a step's width first
happens to be 1 or a multiple of 16: a serving step held for the compile. Rounded up to a
multiple of 16 (at most the table's capacity, which CUDA graphs use whole), the widths fall in
the classes the warm-up compiles (meshllm_kernels/attention/decode_variants.py).
"""

from __future__ import annotations

import numpy as np

WIDTH_MULTIPLE = 16


def table_width(seq_lens: np.ndarray, block_size: int, capacity: int) -> int:
    """Columns for sequences of `seq_lens` tokens in tables of `capacity` columns."""
    blocks = int(-(-int(seq_lens.max()) // block_size))
    return min(capacity, -(-blocks // WIDTH_MULTIPLE) * WIDTH_MULTIPLE)
