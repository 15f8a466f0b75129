"""CUDA graphs for the decode steps of hybrid models (attention + Mamba2 state layers).

The decode graphs of cuda_graphs.py, with every layer handed its own metadata: the attention
layers one Triton metadata over the attention group's block tables (the same static buffers as
a plain model's graph), the state layers one `StateMetadata` whose read / write slots are two
more static int32 buffers (`state_read`, `state_write`), staged with the other inputs in the
one upload. A one-token step of a state layer is one `mamba_decode_step` per layer (meshllm_kernels/
mamba/decode_step.py), in place and capturable; which slots a row reads and writes follows
the entry rule (state_metadata.decode_blocks), computed on the host by `run`.

Padding rows read and write nothing (slot -1: a zero state read, no write), so a padded row
cannot touch a real request's states; their attention padding is the plain graphs' (slot -1,
length 1 over the null block).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from meshllm_kernels.attention.backends import PagedKernelBackend
from services.worker.accel.cuda_graphs import DecodeGraphs
from services.worker.attention.select import TritonAttentionMetadata
from services.worker.attention.state_metadata import StateMetadata
from services.worker.models.base import CausalLM
from services.worker.runner.state_cache import MambaState

LayerMetadata = TritonAttentionMetadata | StateMetadata


class HybridDecodeGraphs(DecodeGraphs):
    """Captured decode forwards of a model with one full-attention and one state group."""

    def __init__(
        self,
        model: CausalLM,
        kv_layers: list[torch.Tensor | MambaState],
        backend: PagedKernelBackend,
        *,
        block_size: int,
        **options: Any,
    ) -> None:
        """`kv_layers`: every layer's cache in layer order (K/V tensor or MambaState)."""
        self.layer_is_state = [isinstance(c, MambaState) for c in kv_layers]
        self.block_size = block_size
        super().__init__(model, kv_layers, backend, **options)  # type: ignore[arg-type]

    def extra_inputs(self, rows: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {"state_read": ((rows,), torch.int32), "state_write": ((rows,), torch.int32)}

    def metadata(self, size: int) -> list[LayerMetadata]:  # type: ignore[override]
        attention = super().metadata(size)
        state = StateMetadata.for_decode_graph(
            size,
            self.block_size,
            self.static["state_read"][:size],
            self.static["state_write"][:size],
        )
        return [state if is_state else attention for is_state in self.layer_is_state]

    @torch.inference_mode()
    def capture(self) -> float:
        self._pad_states(0, self.sizes[-1])
        return super().capture()

    def run_hybrid(
        self,
        input_ids: np.ndarray,
        positions: np.ndarray,
        slot_mapping: np.ndarray,
        seq_lens: np.ndarray,
        block_tables: np.ndarray,
        state_read: np.ndarray,
        state_write: np.ndarray,
    ) -> torch.Tensor:
        """`run` with the state layers' int32 read / write slots per row (-1: zero state /
        no write); `block_tables`: the attention group's rows."""
        n = len(input_ids)
        size = self.graph_size(n)
        host = self.inputs.host()
        host["state_read"][:n], host["state_write"][:n] = state_read, state_write
        self._pad_states(n, size)
        return self.run(input_ids, positions, slot_mapping, seq_lens, block_tables)

    def _pad_states(self, n: int, size: int) -> None:
        host = self.inputs.host()
        host["state_read"][n:size] = -1
        host["state_write"][n:size] = -1
