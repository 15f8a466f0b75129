"""CUDA graphs of a drafter's `observe`, one replay per padded row count: a feature head's
forward over the pairs a step made available (spec/feature_drafter.py: EAGLE, EAGLE-3, MTP;
`HeadObserveGraphs`), or the DFlash draft's context K/V of the step's verified positions
(spec/block_drafter.py; `ContextGraphs`).

Eager, `observe` is one head forward built in Python: the attention metadata, the feature and
token gathers, the head's layer, the write of each row's newest output: about as many kernel
launches as a proposal's, paid on every step a drafter runs (2-3.7 ms of host time a verify
step for a one-layer head of SmolLM2 on the H100 machine, against 0.35-0.5 ms replayed:
bench/RESULTS.md). The proposal that follows is already a graph replay (draft_graphs.py); so
is the verify step before it.

A step whose every row brings at most W = K + 1 pairs (a verify step: the bonus input and the
accepted drafts; a plain decode step: one pair), every pair up to the row's newest, and no row
needing the head KV of a prefix hit filled first (`FeatureDrafter._fill`), runs here: each row
is padded to W pairs at head positions start .. start + W - 1, causal over its own context, so
a real pair never sees a padding pair. The padding pairs (the step's features and tokens past
the row's verified ones) write head KV at positions >= N - 1 (N: the row's known tokens),
which nothing reads before writing them again, as with the head's own rejected drafts
(feature_drafter.py): the proposal runs (draft j, g) at N - 1 + j, each forward writing its
position before attending to it, and positions past its reach are written by the next step's
observe (its verified pairs) or proposal before any forward attends to them. Each row's
output at its newest pair goes to the drafter's `last`; pad rows write a scratch row past the
real ones and no KV (slot -1).

The DFlash draft's `observe` is the same shape without attention: each layer's K/V of the fused
context feature at each verified position (DFlashHead.context_kv). Padded to W positions a
row, its padding positions (>= N - 1) lie inside the next block [N - 1, N - 2 + B] (B >= K + 1),
which writes its own K/V there before its non-causal attention reads them.

Static inputs, uploaded in one copy (cuda_graphs.upload): per row its `last` row, its first
head position, the index of its newest pair, whether it is real, its W tokens t[p + 1] and the
flat indices of its W pairs in the step's hidden states, and its head-KV block table. The
step's hidden states (and auxiliary layer states for EAGLE-3) live in whatever buffer the
step's forward returned, so the W rows of each are gathered into static buffers by one
`index_select` each before the replay; the head's `target_features` runs inside the graph.
"""

from __future__ import annotations

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
from services.worker.accel.draft_graphs import row_slots
from services.worker.attention.context_kv import kernel_insert
from services.worker.attention.select import TritonAttentionMetadata
from services.worker.runner.input_batch import InputBatch
from services.worker.spec.block_drafter import BlockDrafter
from services.worker.spec.feature_drafter import FeatureDrafter

log = logging.getLogger(__name__)


class ObserveGraphs:
    """A drafter's `observe` captured per padded row count: staging, capture, replay. A
    subclass writes `forward` (and sets `reads_hidden` when it reads the final hidden
    states)."""

    reads_hidden = False
    drafter: FeatureDrafter | BlockDrafter

    def __init__(
        self,
        drafter: FeatureDrafter | BlockDrafter,
        *,
        num_spec_tokens: int,
        max_num_reqs: int,
        max_model_len: int,
        sizes: tuple[int, ...] = GRAPH_SIZES,
    ) -> None:
        kv = drafter.kv
        if not isinstance(kv.backend, PagedKernelBackend):
            raise RuntimeError(f"the drafter's {kv.backend.name!r} attention has no graphs")
        self.drafter = drafter
        self.kv = kv
        self.width = num_spec_tokens + 1  # W: pairs per row
        self.device = kv.device
        self.sizes = graph_sizes(max_num_reqs, sizes)
        self.max_model_len = max_model_len
        self.scratch = max_num_reqs  # the `last` row pads write
        rows, width, dev = self.sizes[-1], self.width, self.device
        self.inputs = PackedCpuGpuBuffer(
            {
                "dest": ((rows,), torch.int64),
                "starts": ((rows,), torch.int64),
                "newest": ((rows,), torch.int64),
                "real": ((rows,), torch.int64),
                "tokens": ((rows, width), torch.int64),
                "flat": ((rows, width), torch.int64),
                "block_tables": ((rows, kv.blocks_per_row), torch.int32),  # last: see run
            },
            device=dev,
        )
        self.static = self.inputs.gpu
        target = drafter.target
        hidden_size = target.config.hidden_size
        dtype = next(target.parameters()).dtype
        self.hidden = (
            torch.zeros(rows * width, hidden_size, dtype=dtype, device=dev)
            if self.reads_hidden
            else None
        )
        aux_layers = len(getattr(target, "aux_hidden_layers", ()) or ())
        self.aux = (
            torch.zeros(rows * width, aux_layers * hidden_size, dtype=dtype, device=dev)
            if aux_layers
            else None
        )
        self.offsets = torch.arange(width, dtype=torch.int64, device=dev)
        self.cu_seqlens = torch.arange(rows + 1, dtype=torch.int32, device=dev) * width
        self.token_index = torch.arange(rows * width, dtype=torch.int64, device=dev)
        self.row_index = torch.arange(rows, dtype=torch.int64, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.upload_stream: torch.cuda.Stream | None = None  # steps one at a time: see upload
        self.replayed: torch.cuda.Event | None = None
        self.captured_pool: torch.Tensor | None = None  # the KV pool the graphs read
        self.replays: dict[int, int] = {}

    # -- the captured body ------------------------------------------------------------------

    def positions(self, size: int) -> torch.Tensor:
        """Head positions [size, W] of the pairs."""
        return self.static["starts"][:size].unsqueeze(1) + self.offsets

    def slots(self, size: int) -> torch.Tensor:
        """The KV slots [size, W] of the pairs' positions in each row's table; -1 for pads."""
        st = self.static
        tables, real = st["block_tables"][:size], st["real"][:size]
        return row_slots(tables, real, self.positions(size), self.kv.block_size)

    def metadata(self, size: int) -> TritonAttentionMetadata:
        """Causal attention of each row's W pairs over its own KV, from the static inputs:
        built inside `forward`, so that a replay computes the slots and lengths of its own
        inputs (this is what capture_graphs hands back to it)."""
        st, kv, width = self.static, self.kv, self.width
        return TritonAttentionMetadata(
            num_tokens=size * width,
            slot_mapping=self.slots(size).flatten(),
            token_index=self.token_index[: size * width],
            num_kv_heads=kv.num_kv_heads,
            backend=kv.backend,  # type: ignore[arg-type]
            prefill_block_tables=st["block_tables"][:size],
            prefill_cu_seqlens_q=self.cu_seqlens[: size + 1],
            prefill_seq_lens=(st["starts"][:size] + width).to(torch.int32),
            prefill_max_seqlen_q=width,
        )

    def forward(self, size: int, _: TritonAttentionMetadata) -> torch.Tensor:
        """The captured body over the static inputs' first `size` rows."""
        raise NotImplementedError

    # -- capture ----------------------------------------------------------------------------

    @torch.inference_mode()
    def capture(self) -> float:
        """Capture every size over the drafter's KV pool as it is now; returns seconds."""
        none = np.zeros(0, dtype=np.int64)
        pairs = np.zeros((0, self.width), dtype=np.int64)
        self._stage(none, none, none, pairs, pairs, self.sizes[-1])  # every row a pad
        self.graphs.clear()
        seconds = capture_graphs(self, type(self).__name__)
        self.captured_pool = self.kv.layers[0]
        return seconds

    def attach(self) -> None:
        """Hand the captured graphs to their drafter (its `observe` replays them)."""
        self.drafter.observe_graphs = self

    # -- replay -----------------------------------------------------------------------------

    def takes(
        self, batch: InputBatch, rows: np.ndarray, starts: np.ndarray, ends: np.ndarray
    ) -> bool:
        """A step whose rows each bring 1..W pairs up to their newest, none needing a fill, of
        a captured row count, every padded row within max_model_len."""
        return (
            bool(self.graphs)
            and padded_size(len(rows), self.sizes) is not None
            and bool(((ends - starts) <= self.width).all())
            and bool((ends == batch.num_tokens[rows] - 1).all())
            and bool((self.kv.written[rows] >= starts).all())
            and bool((starts + self.width <= self.max_model_len).all())
        )

    def run(
        self,
        batch: InputBatch,
        hidden: torch.Tensor,
        aux: torch.Tensor | None,
        rows: np.ndarray,
        starts: np.ndarray,
        ends: np.ndarray,
        flat_starts: np.ndarray,
    ) -> None:
        """Replay for these rows (`takes` holds); `flat_starts`: each row's first pair in the
        step's flat hidden states."""
        size = self.load(batch, hidden, rows, starts, ends, flat_starts)
        self.gather(hidden, aux, size)
        self.graphs[size].replay()
        self.replays[size] = self.replays.get(size, 0) + 1

    def load(
        self,
        batch: InputBatch,
        hidden: torch.Tensor,
        rows: np.ndarray,
        starts: np.ndarray,
        ends: np.ndarray,
        flat_starts: np.ndarray,
    ) -> int:
        """Reserve the rows' head KV (recapturing if the pool grew), stage and upload the
        static inputs; returns the padded size."""
        size = padded_size(len(rows), self.sizes)
        assert size is not None
        self.kv.reserve(rows, starts + self.width)
        if self.graphs and self.kv.layers[0] is not self.captured_pool:
            log.info("a drafter's KV pool grew to %d blocks: recapturing", self.kv.num_blocks)
            self.capture()  # the graphs read the old pool
        # Pair i of a row: position start + i, its token t[start + i + 1], its feature at flat
        # index flat_start + i; padding pairs past the step's rows read its last hidden state.
        pairs = starts[:, None] + np.arange(self.width)
        tokens = batch.token_ids[rows[:, None], np.minimum(pairs + 1, batch.token_ids.shape[1] - 1)]
        flat = np.minimum(flat_starts[:, None] + np.arange(self.width), hidden.shape[0] - 1)
        self._stage(rows, starts, ends - starts - 1, tokens, flat, size)
        return size

    def gather(self, hidden: torch.Tensor, aux: torch.Tensor | None, size: int) -> None:
        """The staged pairs' hidden (and auxiliary) states into the static buffers."""
        n = size * self.width
        index = self.static["flat"][:size].flatten()
        if self.hidden is not None:
            torch.index_select(hidden, 0, index, out=self.hidden[:n])
        if self.aux is not None and aux is not None:
            torch.index_select(aux, 0, index, out=self.aux[:n])

    def _stage(
        self,
        rows: np.ndarray,
        starts: np.ndarray,
        newest: np.ndarray,
        tokens: np.ndarray,
        flat: np.ndarray,
        size: int,
    ) -> None:
        n = len(rows)
        host = self.inputs.host()
        host["dest"][:n], host["starts"][:n], host["newest"][:n] = rows, starts, newest
        host["real"][:n], host["tokens"][:n], host["flat"][:n] = 1, tokens, flat
        host["dest"][n:size], host["starts"][n:size], host["newest"][n:size] = self.scratch, 0, 0
        host["real"][n:size], host["tokens"][n:size], host["flat"][n:size] = 0, 0, 0
        tables = host["block_tables"]
        tables[:n] = self.kv.tables[rows]
        tables[n:size] = 0
        upload(self, self.inputs.end("block_tables", size))


class HeadObserveGraphs(ObserveGraphs):
    """A feature head's forward over each row's W pairs; each row's output at its newest pair
    into the drafter's `last`."""

    reads_hidden = True
    drafter: FeatureDrafter

    def forward(self, size: int, _: TritonAttentionMetadata) -> torch.Tensor:
        """Returns the rows' newest outputs [size, H] (pads: into the scratch row)."""
        drafter, st, n = self.drafter, self.static, size * self.width
        head = drafter.head
        aux = self.aux[:n] if self.aux is not None else None
        assert self.hidden is not None
        features = head.target_features(self.hidden[:n], aux)
        embeds = head.embed(st["tokens"][:size].flatten(), drafter.target)
        pos = self.positions(size).flatten()
        g = head(embeds, features, pos, self.metadata(size), self.kv.layers, 0)
        newest = g.view(size, self.width, -1)[self.row_index[:size], st["newest"][:size]]
        drafter.last.index_copy_(0, st["dest"][:size], newest)
        return newest


class ContextGraphs(ObserveGraphs):
    """The DFlash draft's context K/V at each row's W positions (pads write none)."""

    drafter: BlockDrafter

    def forward(self, size: int, _: TritonAttentionMetadata) -> torch.Tensor:
        """Returns the fused context features [size x W, H]."""
        head, n = self.drafter.head, size * self.width
        assert self.aux is not None
        context = head.context(self.aux[:n])
        slots = self.slots(size).flatten()
        pairs = head.context_kv(context, self.positions(size).flatten())
        for (k, v), cache in zip(pairs, self.kv.layers, strict=True):
            kernel_insert(cache, k.to(cache.dtype).contiguous(), v.contiguous(), slots)
        return context
