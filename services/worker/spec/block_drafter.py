"""Drafting a whole block in one forward: the DFlash draft (dflash.py) over a non-causal private
cache (CONTRACTS "Non-causal draft blocks").

Two calls per step, both after the target's sampling/verification, as the feature drafter's
(feature_drafter.py):

- `observe` writes the context: for each position p the step's target computed and verified
  (p from the step's first computed position up to min(KV-verified positions, known tokens -
  1)), every draft layer's K/V of the fused feature at p lands at draft position p. A prefill
  chunk writes its prompt positions, a decode one, a verification step the bonus input and the
  accepted drafts. Writes overwrite what a block wrote there before, so rejected drafts need no
  rollback. A row is ready when its context reaches N - 1 (N known tokens).
- `propose` runs one forward of the draft over each ready row's block [t[N-1], mask x (B - 1)]
  at positions N-1 .. N-2+B, non-causal: every block query sees the context [0, N-1) and the
  whole block. B is the checkpoint's `block_size`, the width it was trained on, whatever the
  K drafts asked for (K <= B - 1): a narrower block would change what each query attends to
  (z-lab's reference always runs B, vLLM's K comes from it); only positions 1..K are read.
  The block's own K/V land at positions >= N-1, past the context, where the next `observe`
  overwrites them. Draft j is drawn from the target's LM head at block position j + 1
  (draft_sampler.py: greedy or sampled with the draft position salt). The drafts of a block
  are drawn independently given the context; q_j is what draft j was drawn from, so
  rejection sampling stays exact.

Positions the target never computed for the request (a prefix-cache hit, KV from a prefill
worker) get the context of a zero feature before the first real one, so the row's cache never
holds another request's K/V (the feature drafter's rule, feature_drafter.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from services.worker.attention.reference import AttentionMetadata
from services.worker.attention.select import TritonAttentionMetadata
from services.worker.models.base import CausalLM
from services.worker.runner.input_batch import InputBatch
from services.worker.spec.dflash import DFlashHead
from services.worker.spec.draft_sampler import DraftSampler, upload_ints
from services.worker.spec.eagle import target_embedding
from services.worker.spec.feature_drafter import FILL_CHUNK, verified_spans
from services.worker.spec.row_kv import RowKV
from services.worker.spec.vocab_map import draft_vocab_map

if TYPE_CHECKING:
    from services.worker.accel.draft_graphs import BlockGraphs
    from services.worker.accel.observe_graphs import ContextGraphs


class BlockDrafter:
    def __init__(
        self,
        head: DFlashHead,
        target: CausalLM,
        target_vocab_size: int,
        num_spec_tokens: int,
        max_num_reqs: int,
        max_model_len: int,
        block_size: int = 16,
        device: torch.device | str = "cpu",
    ) -> None:
        if num_spec_tokens > head.layout.block_size - 1:
            raise ValueError(
                f"{num_spec_tokens} drafts per step exceed the DFlash draft's block of "
                f"{head.layout.block_size} (bonus token + {head.layout.block_size - 1} drafts)"
            )
        vocab = target.config.vocab_size  # the whole vocabulary (a TP rank embeds a shard)
        if not 0 <= head.layout.mask_token_id < vocab:
            raise ValueError(
                f"DFlash mask token {head.layout.mask_token_id} outside the target's "
                f"vocabulary of {vocab}"
            )
        self.head = head
        self.target = target
        self.max_model_len = max_model_len
        self.device = torch.device(device)
        self.vocab_map = draft_vocab_map(target_vocab_size, target.config.vocab_size, None)
        dtype = next(target.parameters()).dtype
        self.kv = RowKV(
            head.config, max_num_reqs, max_model_len, block_size, dtype, self.device,
            non_causal=True,
        )  # fmt: skip
        # Per row: the request and token count its context stands for (ready to propose).
        self.ready_req: list[str | None] = [None] * max_num_reqs
        self.ready_len = np.full(max_num_reqs, -1, dtype=np.int64)
        # On CUDA, the block forward and draws, and observe's context writes, captured per
        # batch size (the runner sets them)
        self.graphs: BlockGraphs | None = None
        self.observe_graphs: ContextGraphs | None = None

    @property
    def mask_token_id(self) -> int:
        return self.head.layout.mask_token_id

    @property
    def block_width(self) -> int:
        """Queries of a block: the draft's trained block_size, whatever K (module docstring)."""
        return self.head.layout.block_size

    @torch.inference_mode()
    def observe(
        self,
        batch: InputBatch,
        hidden: torch.Tensor,
        aux: torch.Tensor | None,
        rows: np.ndarray,
        query_lens: np.ndarray,
        seq_lens: np.ndarray,
    ) -> None:
        """Write the context of this step's rows; `aux` [T, n·H] (the target's auxiliary layer
        states) in flat-batch order (rows, query_lens, seq_lens as the step ran them)."""
        if aux is None:
            raise ValueError("a DFlash draft needs the target's auxiliary layer states")
        spans = verified_spans(batch, rows, query_lens, seq_lens)
        if spans is None:
            return
        rows, starts, ends, flat = spans
        graphs = self.observe_graphs
        if graphs is not None and graphs.takes(batch, rows, starts, ends):
            counts = ends - starts
            graphs.run(batch, hidden, aux, rows, starts, ends, flat[np.cumsum(counts) - counts])
        else:
            context = self.head.context(aux[upload_ints(flat, aux.device)])
            written = self.kv.written
            for i in np.flatnonzero(written[rows] < starts).tolist():  # first context after a hit
                self._fill(int(rows[i]), int(written[rows[i]]), int(starts[i]), context)
            self._write(rows, starts, ends, context)
        self.kv.written[rows] = ends
        for i, row in enumerate(rows.tolist()):
            at_newest = ends[i] == batch.num_tokens[row] - 1
            self.ready_req[row] = batch.row_req[row] if at_newest else None
            self.ready_len[row] = batch.num_tokens[row]

    def release(self, row: int) -> None:
        """The row's request left the batch: its draft KV is free."""
        self.kv.release(row)
        self.ready_req[row] = None

    def ready(self, batch: InputBatch, row: int) -> bool:
        """The row's context covers its current tokens but the newest (a block can start)."""
        return (
            self.ready_req[row] == batch.row_req[row]
            and self.ready_len[row] == batch.num_tokens[row]
        )

    @torch.inference_mode()
    def propose(self, batch: InputBatch, draws: DraftSampler) -> None:
        """Draw `draws.ks[i]` drafts for each row of `draws` (all ready, every k > 0) from one
        non-causal forward of the draft over their blocks: a graph replay when every row
        drafts K (accel/draft_graphs.py BlockGraphs), else eagerly."""
        if self.graphs is not None and self.graphs.takes(draws):
            self.graphs.run(batch, draws)
            return
        rows, ks = draws.rows, draws.ks
        newest = batch.num_tokens[rows] - 1  # block start: the token the target has not read
        # the trained width, cut where it would pass max_model_len (still > k: k <= room)
        counts = np.minimum(self.block_width, self.max_model_len - newest)
        positions = np.concatenate(
            [np.arange(s, s + n) for s, n in zip(newest, counts, strict=True)]
        )
        tokens = np.full(int(counts.sum()), self.head.layout.mask_token_id, dtype=np.int64)
        firsts = np.cumsum(counts) - counts
        tokens[firsts] = batch.token_ids[rows, newest]
        attn = self.kv.metadata(rows, newest + counts, counts, positions)
        out = self.block_forward(
            upload_ints(tokens, self.device), upload_ints(positions, self.device), attn
        )
        # one LM head over every row's positions 1..max k (clipped to its own block)
        k_max = int(ks.max())
        at = firsts[:, None] + np.minimum(np.arange(1, k_max + 1), counts[:, None] - 1)
        logits = self.target.compute_logits(out[upload_ints(at.ravel(), self.device)])
        logits = logits.view(len(rows), k_max, -1)
        for j in range(k_max):
            drawn = np.flatnonzero(ks > j)
            draws.draw(logits[upload_ints(drawn, self.device), j], drawn)

    def block_forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata | TritonAttentionMetadata,
    ) -> torch.Tensor:
        """The draft over flat block tokens at `positions` (non-causal `attn`): outputs [T, H]."""
        embeds = target_embedding(self.target, tokens)
        return self.head(embeds, positions, attn, self.kv.layers)  # type: ignore[no-any-return]

    def _write(
        self, rows: np.ndarray, starts: np.ndarray, ends: np.ndarray, context: torch.Tensor
    ) -> None:
        """Context rows (concatenated row after row) at draft positions [start, end)."""
        counts = ends - starts
        positions = np.concatenate([np.arange(s, e) for s, e in zip(starts, ends, strict=True)])
        slots = self.kv.slots(rows, ends, counts, positions)
        self.head.write_context(
            context,
            upload_ints(positions, self.device),
            upload_ints(slots, self.device),
            self.kv.layers,
        )

    def _fill(self, row: int, start: int, end: int, like: torch.Tensor) -> None:
        """Draft positions [start, end) of `row`, which the target computed no features for:
        the context of a zero feature, in chunks."""
        rows = np.array([row], dtype=np.int64)
        for lo in range(start, end, FILL_CHUNK):
            hi = min(lo + FILL_CHUNK, end)
            zeros = like.new_zeros((hi - lo, like.shape[1]))
            self._write(rows, np.array([lo]), np.array([hi]), zeros)
