"""Python's cyclic garbage collector kept out of CUDA graph captures.

Engines, runners and drafters hold reference cycles (a drafter and its graphs point at each
other; a runner's graphs hold its bound methods), so a dead one, with its CUDA graphs and device
tensors, is freed by the cyclic collector, whenever an allocation count next triggers it. If
that happens in the middle of another capture, the dead graphs' destruction runs CUDA calls
that a capture in the default (global) mode does not allow; PyTorch's graph destructor only
warns on a failed call, so the capture is left invalidated and the next kernel launch in it
fails with "operation failed due to a previous error during capture". PyTorch's
`torch.cuda.graph` no longer collects before capturing (only under
`torch.compiler.config.force_cudagraph_gc`). So every capture here runs after a full
collection, with the collector off until the captures are done; vLLM and SGLang do the same
around their captures.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def collected_then_paused() -> Iterator[None]:
    """Collect every generation now, then keep the cyclic collector off inside the block (as
    it was on entry afterwards, whatever the block raised)."""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
