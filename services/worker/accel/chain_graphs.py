"""Whole chained verify steps as CUDA graphs: the layout kernel, the forward, the LM head, the
draws and the acceptance of a step (services/worker/spec/chain.py) in one replay.

Chained, a verify step no longer waits for the host, but launching its pieces from Python
(the tables' upload, the layout kernel, the verify graph, the LM head, the draw, the
acceptance kernel, the copy back) cost the H100 machine's host ~1.3 ms a step at batch 16,
more than the device's work: the GPU ran at the host's pace (bench/RESULTS.md). Here the
host writes each request's batch row, lookahead slots and token limit next to the block
tables, uploads them in one copy and replays one graph; the packed result is copied out of
the graph's output before the next replay can overwrite it.

Pad requests (a batch of R run in the graph of the next captured size) use the chain's
scratch row with a token limit of 0: inactive, they write no KV, no token a request owns and
no newest token. A graph holds one sampling configuration, the plain draw (temperature and
seed, no truncation, logprobs or per-entry stage): a step whose requests need more runs the
pieces one by one (chain_step.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from meshllm_kernels.attention.backends import PagedKernelBackend
from services.worker.accel.cuda_graphs import capture_graphs
from services.worker.accel.verify_graphs import VerifyGraphs
from services.worker.attention.select import TritonAttentionMetadata
from services.worker.models.base import CausalLM
from services.worker.sampling import SamplingState
from services.worker.spec.chain import DraftChain

REQUEST_FIELDS = ("rows", "lookahead", "limits")


class ChainGraphs(VerifyGraphs):
    def __init__(
        self,
        model: CausalLM,
        kv_layers: list[torch.Tensor],
        backend: PagedKernelBackend,
        *,
        chain: DraftChain,
        sampler: SamplingState,
        compute_logits: Callable[[torch.Tensor], torch.Tensor],
        latest: torch.Tensor,
        **spans: Any,
    ) -> None:
        super().__init__(
            model, kv_layers, backend, num_spec_tokens=chain.k, request_fields=REQUEST_FIELDS,
            **spans,
        )  # fmt: skip
        self.chain = chain
        self.sampler = sampler
        self.compute_logits = compute_logits
        self.latest = latest

    def forward(self, size: int, meta: TritonAttentionMetadata) -> torch.Tensor:
        static = self.static
        rows = static["rows"][:size]
        step = self.chain.lay_out(
            rows, static["lookahead"][:size], static["limits"][:size],
            static["block_tables"][:size], self.block_size, 0, into=static,
        )  # fmt: skip
        logits = self.compute_logits(super().forward(size, meta))
        # a pad's scratch row reads some state row's parameters; its draws count for nothing
        state_rows = rows.clamp(max=self.sampler.max_num_reqs - 1).repeat_interleave(self.width)
        draws = self.sampler.sample(logits, state_rows, step.positions + 1).token_ids
        return self.chain.accept(rows, step, draws.view(size, self.width), self.latest)

    @torch.inference_mode()
    def capture(self) -> float:
        """Capture every size over pad requests only (they touch the scratch row alone)."""
        empty = np.zeros(0, dtype=np.int64)
        self.stage_step(self.sizes[-1], empty, empty, empty, np.zeros((0, 1), dtype=np.int64))
        return capture_graphs(self, "chained verify")

    def stage_step(
        self,
        size: int,
        rows: np.ndarray,
        lookahead: np.ndarray,
        limits: np.ndarray,
        block_tables: np.ndarray,
    ) -> None:
        """Write the step's requests (batch rows, lookahead slots, token limits, block tables)
        and pads up to `size`, and upload them in one copy."""
        n = len(rows)
        pads = size - n
        step = {
            "rows": np.concatenate([rows, np.full(pads, self.chain.scratch_row, dtype=np.int64)]),
            "lookahead": np.concatenate([lookahead, np.zeros(pads, dtype=np.int64)]),
            "limits": np.concatenate([limits, np.zeros(pads, dtype=np.int64)]),
        }
        self._stage(0, step, block_tables, size)

    def run_step(self, size: int, num_reqs: int) -> torch.Tensor:
        """Replay the staged step; its packed result [num_reqs, W + 2], copied out of the
        graph's output (the next replay rewrites that)."""
        return self._replay(size)[:num_reqs].clone()
