"""Paged attention as one opaque op for a compiled forward (services/worker/accel/cpu_compile.py).

torch.compile traces the model's dense layers (norms, RoPE, linears, SwiGLU) into one graph,
but the attention of a step is per-step Python: the block tables, the decode window, the
variable-length prefill spans. Tracing it would specialise the graph to one step's shape and
recompile on the next. So the compiled forward calls `meshllm::bound_paged_attention(q, k, v,
kv_cache, layer, scale)`, an op the compiler only sees as "writes kv_cache, returns [T, heads *
d]"; its body runs the eager paged path (services/worker/attention/reference.py) with the metadata
that `bind` attached to the step. vLLM's CPU and GPU backends do the same (a forward context read by
an opaque attention op).

The binding is per thread: the op reads the metadata of the forward its own thread runs.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from services.worker.attention.reference import AttentionMetadata, paged_attention

_LIBRARY = torch.library.Library("meshllm", "DEF")
_LIBRARY.define(
    "bound_paged_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) kv_cache, int layer, "
    "float scale) -> Tensor"
)


class _Binding(threading.local):
    metas: Sequence[AttentionMetadata] | None = None


_BINDING = _Binding()


@contextmanager
def bind(metas: Sequence[AttentionMetadata]) -> Iterator[None]:
    """Attach one step's per-layer metadata to this thread for the duration of its forward."""
    previous, _BINDING.metas = _BINDING.metas, metas
    try:
        yield
    finally:
        _BINDING.metas = previous


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    scale: float,
) -> torch.Tensor:
    metas = _BINDING.metas
    if metas is None:
        raise RuntimeError("meshllm::bound_paged_attention ran outside bind(): no step metadata")
    return paged_attention(q, k, v, kv_cache, metas[layer], scale)


def _attend_shape(q: torch.Tensor, *_: object) -> torch.Tensor:
    """What the compiler sees: [T, heads * d] (kv_cache's mutation is in the schema)."""
    return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])


_LIBRARY.impl("bound_paged_attention", _attend, "CPU")
torch.library.register_fake("meshllm::bound_paged_attention", _attend_shape, lib=_LIBRARY)


@dataclass(frozen=True)
class LayerAttention:
    """Stands in for a layer's AttentionMetadata inside a compiled forward: the layer index is
    all the graph holds; the step's real metadata is bound around the call."""

    layer: int

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """q [T, heads, d] (rotated), k/v [T, kv_heads, d] -> [T, heads * d]."""
        out: torch.Tensor = torch.ops.meshllm.bound_paged_attention(
            q, k, v, kv_cache, self.layer, scale
        )
        return out
