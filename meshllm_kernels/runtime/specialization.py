"""Triton's specializations that a serving kernel opts out of.

Triton compiles a kernel again for each new class of its integer arguments (1, a multiple of
16, other) and of its pointers' alignment (a multiple of 16 bytes or not). An argument that
follows the batch (a count, a view into one upload at an offset of `batch` elements) would
compile a new kernel in the middle of a serving step, outside the warm-up and the CUDA
graphs. `jit_options` lists such arguments for `triton.jit`; the alignment option exists in
Triton >= 3.2 and is left out on older ones (a compile more, nothing wrong).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import triton


def jit_options(values: Sequence[str] = (), alignments: Sequence[str] = ()) -> dict[str, Any]:
    """`triton.jit` keyword arguments: no specialization on the values of the arguments in
    `values`, nor on the alignment of the pointers in `alignments` (for pointers a program
    reads one element of: no vector load is lost)."""
    options: dict[str, Any] = {}
    if values:
        options["do_not_specialize"] = list(values)
    if alignments and "do_not_specialize_on_alignment" in inspect.signature(triton.jit).parameters:
        options["do_not_specialize_on_alignment"] = list(alignments)
    return options
