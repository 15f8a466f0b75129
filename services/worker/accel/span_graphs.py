"""What the graph sets whose steps run every request as a span of the paged prefill kernel
share (verify_graphs.py, prefill_graphs.py): the model and cache they capture, static inputs in
one packed host/device buffer (inputs fields, the block tables last so that a step uploads only
its rows), one graph and output per captured size, and the replay itself."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import numpy as np
import torch

from meshllm_kernels.attention.backends import PagedKernelBackend
from meshllm_kernels.runtime.staged_copy import PackedCpuGpuBuffer
from services.worker.accel.cuda_graphs import no_phase, upload
from services.worker.models.base import CausalLM

Fields = dict[str, tuple[tuple[int, ...], torch.dtype]]
TOKEN_FIELDS = ("input_ids", "positions", "slots")  # one row per (padded) token


class SpanGraphs:
    def __init__(
        self,
        model: CausalLM,
        kv_layers: list[torch.Tensor],
        backend: PagedKernelBackend,
        *,
        sizes: tuple[int, ...],
        fields: Fields,
        tokens: int,
        device: torch.device | str,
        upload_stream: torch.cuda.Stream | None,
    ) -> None:
        self.model = model
        self.kv_layers = kv_layers
        self.backend = backend
        self.sizes = sizes
        self.device = torch.device(device)
        self.upload_stream = upload_stream
        self.replayed = torch.cuda.Event() if upload_stream is not None else None
        self.num_kv_heads = model.config.num_key_value_heads
        self.inputs = PackedCpuGpuBuffer(fields, device=self.device)
        self.static = self.inputs.gpu
        self.token_index = torch.arange(tokens, dtype=torch.int64, device=self.device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.replays: Counter[int] = Counter()  # steps run from each size's graph
        # called with "staged" before a replay and "replayed" after it (the step timeline's
        # marks: ModelRunner.mark_phase)
        self.on_phase: Callable[[str], None] = no_phase

    def _replay(self, size: int) -> torch.Tensor:
        """Replay the graph of `size` (its inputs staged); returns its static output."""
        self.on_phase("staged")
        self.graphs[size].replay()
        self.on_phase("replayed")
        if self.replayed is not None:
            self.replayed.record()
        self.replays[size] += 1
        return self.outputs[size]

    def _stage(
        self,
        tokens: int,
        step: dict[str, np.ndarray],
        block_tables: np.ndarray,
        table_rows: int,
    ) -> None:
        """Write a padded step into the host buffers: `step`'s fields (input_ids, positions,
        slots over the first `tokens` rows, the others whole or their first rows), the
        requests' block tables then zero rows up to `table_rows` (pads read block 0 only);
        upload it in one copy (on the upload stream on CUDA, as the decode graphs do)."""
        host = self.inputs.host()
        for name, values in step.items():
            host[name][: tokens if name in TOKEN_FIELDS else len(values)] = values
        tables = host["block_tables"]
        n = len(block_tables)
        width = min(block_tables.shape[1], tables.shape[1])
        tables[:n, :width] = block_tables[:, :width]
        tables[:n, width:] = 0
        tables[n:table_rows] = 0
        upload(self, self.inputs.end("block_tables", table_rows))
