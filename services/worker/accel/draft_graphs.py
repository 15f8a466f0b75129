"""CUDA graphs of a feature head's draft loop (spec/feature_drafter.py: EAGLE, EAGLE-3, MTP): the
K draws and K - 1 head forwards of one proposal in one replay per padded row count.

Eager, a proposal is K x (the head's logits, the draw, q's softmax) plus K - 1 head forwards:
a few hundred kernel launches from Python, more than a small head's GPU time, paid on every
verify step (which is itself one graph replay, accel/verify_graphs.py). Captured per size R
(cuda_graphs.GRAPH_SIZES up to max_num_reqs), every row of a replay drafts K: a proposal takes
the graphs only when each of its rows drafts K (rows near max_model_len or max_tokens draft
fewer, eagerly).

Static inputs, uploaded in one copy (cuda_graphs.upload): per row its batch row (its kept
output in the drafter's `last`; pads read row 0), N (its known tokens: draft j is drawn at
N + j + the draft salt, head forward j runs at position N - 1 + j), its head KV block table
and whether it is real (a pad writes no KV: slot -1; its reads of block 0 are ignored). The
draws' inverse temperature and seed come from the proposal's DraftSampler (device copies).
Outputs: the drafts [K, R] as target ids and q [R, K, V] (softmax of logits / T over the
target vocabulary, zero where a smaller draft vocabulary has no token; read for rows at
temperature > 0 only), handed to the DraftSampler, so the proposal equals the eager loop's.

The head's KV pool (spec/row_kv.py) grows by reallocation and the graphs hold its tensors:
the pool is sized at capture for what the target's cache can hold (plus K per row), and a
pool that grows past it anyway (many rows sharing a cached prefix hold more head positions
than the target's cache) is recaptured before the next replay.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import torch

from meshllm_kernels.attention.backends import PagedKernelBackend
from meshllm_kernels.runtime.staged_copy import PackedCpuGpuBuffer
from services.worker.accel.cuda_graphs import (
    GRAPH_SIZES,
    capture_graphs,
    graph_sizes,
    padded_size,
    upload,
)
from services.worker.attention.select import TritonAttentionMetadata, decode_splits
from services.worker.runner.input_batch import InputBatch
from services.worker.spec.draft_sampler import DraftSampler
from services.worker.spec.draws import DRAFT_POSITION_SALT, gumbel_draw
from services.worker.spec.feature_drafter import FeatureDrafter
from services.worker.spec.vocab_map import to_target_ids

log = logging.getLogger(__name__)


class DraftGraphs:
    def __init__(
        self,
        drafter: FeatureDrafter,
        *,
        num_spec_tokens: int,
        target_vocab_size: int,
        max_num_reqs: int,
        max_model_len: int,
        sizes: tuple[int, ...] = GRAPH_SIZES,
    ) -> None:
        if not isinstance(drafter.kv.backend, PagedKernelBackend):
            raise RuntimeError(f"the head's {drafter.kv.backend.name!r} attention has no graphs")
        self.drafter = drafter
        self.k = num_spec_tokens
        self.device = drafter.device
        self.sizes = graph_sizes(max_num_reqs, sizes)
        self.max_model_len = max_model_len
        rows, kv = self.sizes[-1], drafter.kv
        self.inputs = PackedCpuGpuBuffer(
            {
                "rows": ((rows,), torch.int64),
                "base": ((rows,), torch.int64),
                "real": ((rows,), torch.int64),
                "block_tables": ((rows, kv.blocks_per_row), torch.int32),  # last: see _stage
            },
            device=self.device,
        )
        self.static = self.inputs.gpu
        self.inv_temperature = torch.zeros(rows, dtype=torch.float32, device=self.device)
        self.seeds = torch.zeros(rows, dtype=torch.int64, device=self.device)
        self.q = torch.zeros(rows, self.k, target_vocab_size, device=self.device)
        self.vocab_map = (
            drafter.vocab_map.to(self.device) if drafter.vocab_map is not None else None
        )
        self.token_index = torch.arange(rows, dtype=torch.int64, device=self.device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.upload_stream: torch.cuda.Stream | None = None  # steps one at a time: see upload
        self.replayed: torch.cuda.Event | None = None
        self.captured_pool: torch.Tensor | None = None  # the KV pool the graphs read
        self.replays: dict[int, int] = {}

    # -- capture ----------------------------------------------------------------------------

    def metadata(self, size: int) -> TritonAttentionMetadata:
        """The head forwards' decode metadata over the first `size` rows; each forward of the
        loop replaces its slots and sequence lengths (`forward`)."""
        kv = self.drafter.kv
        return TritonAttentionMetadata(
            num_tokens=size,
            slot_mapping=self.static["rows"][:size],  # replaced per forward
            token_index=self.token_index[:size],
            num_kv_heads=kv.num_kv_heads,
            backend=kv.backend,  # type: ignore[arg-type]
            num_decodes=size,
            decode_block_tables=self.static["block_tables"][:size],
            decode_seq_lens=self.static["base"][:size].to(torch.int32),  # replaced per forward
            decode_max_seq_len=self.max_model_len,
            decode_num_splits=decode_splits(size, kv.num_kv_heads, self.max_model_len, self.device),
        )

    def forward(self, size: int, meta: TritonAttentionMetadata) -> torch.Tensor:
        """The loop over the static inputs' first `size` rows: drafts [K, size] (target ids);
        q into `self.q`."""
        drafter, st = self.drafter, self.static
        head, target, kv = drafter.head, drafter.target, drafter.kv
        base, tables = st["base"][:size], st["block_tables"][:size]
        real = st["real"][:size] != 0
        inv_temperature, seeds = self.inv_temperature[:size], self.seeds[:size]
        scale = torch.where(inv_temperature == 0, 1.0, inv_temperature).unsqueeze(1)
        g = drafter.last[st["rows"][:size]]
        drafts = []
        for j in range(self.k):
            logits = head.draft_logits(g, target, j)
            ids = gumbel_draw(logits, inv_temperature, seeds, base + j + DRAFT_POSITION_SALT)
            probs = torch.softmax(logits.float() * scale, dim=-1)
            if self.vocab_map is None:
                self.q[:size, j] = probs
            else:
                self.q[:size, j, self.vocab_map] = probs
            drafts.append(to_target_ids(ids, self.vocab_map))
            if j + 1 == self.k:
                break
            pos = base - 1 + j  # the head position of (draft j, g)
            block = tables.gather(1, (pos // kv.block_size).unsqueeze(1)).squeeze(1)
            slots = torch.where(real, block.long() * kv.block_size + pos % kv.block_size, -1)
            step = dataclasses.replace(
                meta, slot_mapping=slots, decode_seq_lens=(pos + 1).to(torch.int32), rope=None
            )
            g = head(head.embed(drafts[-1], target), g, pos, step, kv.layers, j + 1)
        return torch.stack(drafts)

    @torch.inference_mode()
    def capture(self, pool_blocks: int = 0) -> float:
        """Capture every size over a head KV pool of at least `pool_blocks` blocks; returns
        seconds."""
        kv = self.drafter.kv
        if pool_blocks > kv.num_blocks:
            kv.grow_to(pool_blocks)
        self._stage(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64), self.sizes[-1])
        self.graphs.clear()
        seconds = capture_graphs(self, "draft loop")
        self.captured_pool = kv.layers[0]
        return seconds

    # -- replay -----------------------------------------------------------------------------

    def takes(self, draws: DraftSampler) -> bool:
        """A proposal of a captured size whose every row drafts K."""
        return (
            bool(self.graphs)
            and padded_size(len(draws.rows), self.sizes) is not None
            and bool((draws.ks == self.k).all())
        )

    def run(self, batch: InputBatch, draws: DraftSampler) -> None:
        """Replay the loop for the rows of `draws`; their drafts and q land in `draws`."""
        size, n = self.load(batch, draws), len(draws.rows)
        self.graphs[size].replay()
        self.replays[size] = self.replays.get(size, 0) + 1
        draws.take(self.outputs[size][:, :n].clone(), self.q[:n])

    def load(self, batch: InputBatch, draws: DraftSampler) -> int:
        """Stage the static inputs for the rows of `draws` (head KV blocks reserved first,
        recapturing if that grew the pool); returns the padded size that runs them."""
        rows, n = draws.rows, len(draws.rows)
        size = padded_size(n, self.sizes)
        assert size is not None
        base = batch.num_tokens[rows]
        kv = self.drafter.kv
        if self.k > 1:  # the last head forward's sequence ends at N + K - 2
            kv.reserve(rows, base + self.k - 2)
        if self.graphs and kv.layers[0] is not self.captured_pool:
            log.info("the draft head's KV pool grew to %d blocks: recapturing", kv.num_blocks)
            self.capture()  # the graphs read the old pool
        self.inv_temperature[:n] = draws.inv_temperature
        self.seeds[:n] = draws.seeds
        self._stage(rows, base, size)
        return size

    def _stage(self, rows: np.ndarray, base: np.ndarray, size: int) -> None:
        n = len(rows)
        host = self.inputs.host()
        host["rows"][:n], host["base"][:n], host["real"][:n] = rows, base, 1
        host["rows"][n:size], host["base"][n:size], host["real"][n:size] = 0, 1, 0
        tables = host["block_tables"]
        tables[:n] = self.drafter.kv.tables[rows]
        tables[n:size] = 0
        upload(self, self.inputs.end("block_tables", size))
