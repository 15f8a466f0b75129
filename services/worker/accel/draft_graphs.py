"""CUDA graphs of a drafter's draft loop: a feature head's (spec/feature_drafter.py: EAGLE,
EAGLE-3, MTP) K draws and K - 1 head forwards, a draft model's (spec/draft_model.py) K - 1
decode forwards and draws after its eager catch-up and first draw, or the DFlash draft's
(spec/block_drafter.py) one non-causal block forward and its K draws, in one replay per padded
row count.

Eager, a proposal is K x (the drafter's logits, the draw, q's softmax) plus K - 1 forwards: a
few hundred kernel launches from Python, more than a small drafter's GPU time, paid on every
verify step (which is itself one graph replay, accel/verify_graphs.py). Captured per size R
(cuda_graphs.GRAPH_SIZES up to max_num_reqs), every row of a replay drafts K: a proposal takes
the graphs only when each of its rows drafts K (rows near max_model_len or max_tokens draft
fewer, eagerly).

Static inputs, uploaded in one copy (cuda_graphs.upload): per row its batch row (a head's kept
output in the drafter's `last`; pads read row 0), N (its known tokens: draft j is drawn at
N + j + the draft salt), its KV block table and whether it is real (a pad writes no KV: slot
-1; its reads of block 0 are ignored); a draft model's first draft (its input) is copied on the
device. Forward i of the loop runs at position N - 1 + i (a head: the pair (draft i, g)) or
N + i (a draft model: draft i fed back). The draws' inverse temperature and seed come from the
proposal's DraftSampler (device copies). Outputs: the drafts as target ids and q (softmax of
logits / T over the target vocabulary, zero where a smaller draft vocabulary has no token; read
for rows at temperature > 0 only), handed to the DraftSampler, so the proposal equals the
eager loop's.

Memory: q is static, [max_num_reqs, K, V] float32 (64 x 4 x 49,152 for SmolLM2 at the
defaults: 50 MB; an eager proposal with a sampled row allocates its rows' share each time).
The drafter's KV pool (spec/row_kv.py) grows by reallocation and the graphs hold its tensors:
the pool is sized at capture for what the target's cache can hold (plus K per row), and a pool
that grows past it anyway (many rows sharing a cached prefix hold more draft positions than the
target's cache) is recaptured before the next replay.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

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
from services.worker.spec.block_drafter import BlockDrafter
from services.worker.spec.draft_model import DraftModelDrafter
from services.worker.spec.draft_sampler import DraftSampler
from services.worker.spec.draws import DRAFT_POSITION_SALT, gumbel_draw
from services.worker.spec.feature_drafter import FeatureDrafter
from services.worker.spec.vocab_map import to_target_ids

log = logging.getLogger(__name__)


def row_slots(
    block_tables: torch.Tensor, real: torch.Tensor, pos: torch.Tensor, block_size: int
) -> torch.Tensor:
    """The KV slots of positions `pos` [R, W] in each row's block table [R, blocks]; -1 for
    the rows whose `real` is 0 (graph padding: the KV insert skips them)."""
    block = block_tables.gather(1, pos // block_size).long()
    return torch.where((real != 0).unsqueeze(1), block * block_size + pos % block_size, -1)


class LoopGraphs:
    """What the loops share: static inputs, capture, staging, replay. A subclass sets
    `first_draft` (the drafts before the loop: 0 or 1), `shift` (forward i runs at position
    N + shift + i) and writes `forward`."""

    first_draft = 0
    shift = 0

    def __init__(
        self,
        drafter: FeatureDrafter | DraftModelDrafter | BlockDrafter,
        *,
        num_spec_tokens: int,
        target_vocab_size: int,
        max_num_reqs: int,
        max_model_len: int,
        sizes: tuple[int, ...] = GRAPH_SIZES,
    ) -> None:
        kv, vocab_map = drafter.kv, drafter.vocab_map
        if not isinstance(kv.backend, PagedKernelBackend):
            raise RuntimeError(f"the drafter's {kv.backend.name!r} attention has no graphs")
        self.drafter = drafter
        self.kv = kv
        self.k = num_spec_tokens
        self.device = kv.device
        self.sizes = graph_sizes(max_num_reqs, sizes)
        self.max_model_len = max_model_len
        rows, dev = self.sizes[-1], self.device
        self.inputs = PackedCpuGpuBuffer(
            {
                "rows": ((rows,), torch.int64),
                "base": ((rows,), torch.int64),
                "real": ((rows,), torch.int64),
                "newest": ((rows,), torch.int64),  # t[N-1]: a block's first token
                "block_tables": ((rows, kv.blocks_per_row), torch.int32),  # last: see _stage
            },
            device=dev,
        )
        self.static = self.inputs.gpu
        self.inv_temperature = torch.zeros(rows, dtype=torch.float32, device=dev)
        self.seeds = torch.zeros(rows, dtype=torch.int64, device=dev)
        self.first_ids = torch.zeros(rows, dtype=torch.int64, device=dev)  # a draft model's
        drawn = self.k - self.first_draft
        self.q = torch.zeros(rows, drawn, target_vocab_size, device=dev)
        self.vocab_map = vocab_map.to(dev) if vocab_map is not None else None
        self.token_index = torch.arange(rows, dtype=torch.int64, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.upload_stream: torch.cuda.Stream | None = None  # steps one at a time: see upload
        self.replayed: torch.cuda.Event | None = None
        self.captured_pool: torch.Tensor | None = None  # the KV pool the graphs read
        self.replays: dict[int, int] = {}

    # -- capture ----------------------------------------------------------------------------

    def metadata(self, size: int) -> TritonAttentionMetadata:
        """The loop's decode metadata over the first `size` rows; each forward replaces its
        slots and sequence lengths (`_at`)."""
        kv = self.kv
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
        """The loop over the static inputs' first `size` rows: the drafts it draws [K -
        first_draft, size] (target ids); q into `self.q`."""
        raise NotImplementedError

    def attach(self) -> None:
        """Hand the captured graphs to their drafter (its proposals replay them)."""
        self.drafter.graphs = self  # type: ignore[assignment]

    def _at(self, meta: TritonAttentionMetadata, size: int, i: int) -> tuple[torch.Tensor, Any]:
        """(positions, metadata) of forward i: each real row's slot at N + shift + i in its
        table, -1 for pads."""
        pos = self.static["base"][:size] + (self.shift + i)
        slots = self._slots(size, pos.unsqueeze(1)).squeeze(1)
        lens = (pos + 1).to(torch.int32)
        return pos, dataclasses.replace(meta, slot_mapping=slots, decode_seq_lens=lens, rope=None)

    def _slots(self, size: int, pos: torch.Tensor) -> torch.Tensor:
        """The KV slots of positions `pos` [size, W] in each row's table; -1 for pad rows."""
        st = self.static
        return row_slots(st["block_tables"][:size], st["real"][:size], pos, self.kv.block_size)

    def _draw(self, size: int, j: int, logits: torch.Tensor) -> torch.Tensor:
        """Draft j of every row from its logits (the drafter's vocabulary), as DraftSampler.draw
        draws it; q into `self.q`; returns the drafter's own ids (its next input)."""
        inv_temperature = self.inv_temperature[:size]
        positions = self.static["base"][:size] + (j + DRAFT_POSITION_SALT)
        ids = gumbel_draw(logits, inv_temperature, self.seeds[:size], positions)
        scale = torch.where(inv_temperature == 0, 1.0, inv_temperature).unsqueeze(1)
        probs = torch.softmax(logits.float() * scale, dim=-1)
        if self.vocab_map is None:
            self.q[:size, j - self.first_draft] = probs
        else:
            self.q[:size, j - self.first_draft, self.vocab_map] = probs
        return ids

    @torch.inference_mode()
    def capture(self, pool_blocks: int = 0) -> float:
        """Capture every size over a KV pool of at least `pool_blocks` blocks; returns
        seconds."""
        if pool_blocks > self.kv.num_blocks:
            self.kv.grow_to(pool_blocks)
        self._stage(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64), self.sizes[-1])
        self.graphs.clear()
        seconds = capture_graphs(self, type(self).__name__)
        self.captured_pool = self.kv.layers[0]
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
        """Stage the static inputs for the rows of `draws` (KV blocks reserved first,
        recapturing if that grew the pool); returns the padded size that runs them."""
        rows, n = draws.rows, len(draws.rows)
        size = padded_size(n, self.sizes)
        assert size is not None
        base = batch.num_tokens[rows]
        self.kv.reserve(rows, self.kv_ends(base))
        if self.graphs and self.kv.layers[0] is not self.captured_pool:
            log.info("a drafter's KV pool grew to %d blocks: recapturing", self.kv.num_blocks)
            self.capture()  # the graphs read the old pool
        self.inv_temperature[:n] = draws.inv_temperature
        self.seeds[:n] = draws.seeds
        self._stage(rows, base, size, batch.token_ids[rows, base - 1])
        return size

    def kv_ends(self, base: np.ndarray) -> np.ndarray:
        """Where each row's KV must reach: the last forward's sequence end, N + shift + K - 1
        (N when the loop has no forward)."""
        return base + (self.shift + self.k - 1 if self.k > 1 else 0)

    def _stage(
        self, rows: np.ndarray, base: np.ndarray, size: int, newest: np.ndarray | None = None
    ) -> None:
        n = len(rows)
        host = self.inputs.host()
        host["rows"][:n], host["base"][:n], host["real"][:n] = rows, base, 1
        host["newest"][:n] = newest if newest is not None else 0
        host["rows"][n:size], host["base"][n:size], host["real"][n:size] = 0, 1, 0
        host["newest"][n:size] = 0
        tables = host["block_tables"]
        tables[:n] = self.kv.tables[rows]
        tables[n:size] = 0
        upload(self, self.inputs.end("block_tables", size))


class DraftGraphs(LoopGraphs):
    """A feature head's loop: draw j from g, feed (draft j, g) at N - 1 + j for the next g."""

    shift = -1

    drafter: FeatureDrafter

    def forward(self, size: int, meta: TritonAttentionMetadata) -> torch.Tensor:
        head, target = self.drafter.head, self.drafter.target
        g = self.drafter.last[self.static["rows"][:size]]
        drafts = []
        for j in range(self.k):
            ids = self._draw(size, j, head.draft_logits(g, target, j))
            drafts.append(to_target_ids(ids, self.vocab_map))
            if j + 1 < self.k:
                pos, step = self._at(meta, size, j)
                g = head(head.embed(drafts[-1], target), g, pos, step, self.kv.layers, j + 1)
        return torch.stack(drafts)


class DraftModelGraphs(LoopGraphs):
    """A draft model's loop after its eager catch-up and first draw (`first_ids`, its own
    ids): feed draft j - 1 at N + j - 1, draw draft j, for j = 1 .. K - 1."""

    first_draft = 1

    drafter: DraftModelDrafter

    def forward(self, size: int, meta: TritonAttentionMetadata) -> torch.Tensor:
        model = self.drafter.model
        ids = self.first_ids[:size]
        drafts = []
        for j in range(1, self.k):
            pos, step = self._at(meta, size, j - 1)
            hidden = model(ids, pos, step, self.kv.layers)
            ids = self._draw(size, j, model.compute_logits(hidden))
            drafts.append(to_target_ids(ids, self.vocab_map))
        return torch.stack(drafts)

    def takes(self, draws: DraftSampler) -> bool:
        return self.k > 1 and super().takes(draws)

    def run_after_first(
        self, batch: InputBatch, draws: DraftSampler, first_ids: torch.Tensor
    ) -> None:
        """The loop after draft 0 (`first_ids`, the draft model's ids of every row)."""
        self.first_ids[: len(first_ids)] = first_ids
        self.run(batch, draws)


class BlockGraphs(LoopGraphs):
    """The DFlash draft's one forward (spec/block_drafter.py): each row's block [t[N-1],
    mask x (B - 1)] at positions N-1 .. N-2+B (B its trained width), non-causal over its context
    and block, then the K draws from the target's LM head at block positions 1..K. Taken when
    every row's whole block fits max_model_len (else eagerly, cut there)."""

    shift = -1

    drafter: BlockDrafter

    def __init__(self, drafter: BlockDrafter, **sizes: Any) -> None:
        super().__init__(drafter, **sizes)
        rows, width = self.sizes[-1], drafter.block_width
        self.width = width
        self.offsets = torch.arange(width, dtype=torch.int64, device=self.device)
        self.cu_seqlens = torch.arange(rows + 1, dtype=torch.int32, device=self.device) * width
        self.block_index = torch.arange(rows * width, dtype=torch.int64, device=self.device)

    def kv_ends(self, base: np.ndarray) -> np.ndarray:
        return base - 1 + self.width  # the block's last position is N - 2 + B

    def takes(self, draws: DraftSampler) -> bool:
        fits = draws.base - 1 + self.width <= self.max_model_len
        return super().takes(draws) and bool(fits.all())

    def forward(self, size: int, meta: TritonAttentionMetadata) -> torch.Tensor:
        drafter, st, kv = self.drafter, self.static, self.kv
        width = self.width
        base = st["base"][:size]
        pos = (base - 1).unsqueeze(1) + self.offsets  # [size, B]
        first = self.offsets == 0
        tokens = torch.where(first, st["newest"][:size].unsqueeze(1), drafter.mask_token_id)
        slots = self._slots(size, pos)
        attn = TritonAttentionMetadata(
            num_tokens=size * width,
            slot_mapping=slots.flatten(),
            token_index=self.block_index[: size * width],
            num_kv_heads=kv.num_kv_heads,
            backend=kv.backend,  # type: ignore[arg-type]
            prefill_block_tables=st["block_tables"][:size],
            prefill_cu_seqlens_q=self.cu_seqlens[: size + 1],
            prefill_seq_lens=(base - 1 + width).to(torch.int32),
            prefill_max_seqlen_q=width,
            causal=False,
        )
        out = drafter.block_forward(tokens.flatten(), pos.flatten(), attn)
        read = out.view(size, width, -1)[:, 1 : self.k + 1]  # the K drafts' positions
        logits = drafter.target.compute_logits(read.flatten(0, 1))
        logits = logits.view(size, self.k, -1)
        drafts = [
            to_target_ids(self._draw(size, j, logits[:, j]), self.vocab_map) for j in range(self.k)
        ]
        return torch.stack(drafts)
