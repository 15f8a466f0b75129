"""Drafting from the target's own features: EAGLE (eagle.py), EAGLE-3 (eagle3.py) and MTP
(mtp.py) heads, one loop for all three.

A head maps (embedding of token t[p+1], feature at p) to an output g[p] that predicts t[p+2]
and is fed back as the next feature. The target's feature at p is `head.target_features(...)`
of the step's outputs: its final hidden state (EAGLE, MTP) or its fused auxiliary layer states
(EAGLE-3). Two calls per step, both after the target's sampling/verification:

- `observe` runs the head over every pair (f[p], t[p+1]) the step made available: p from the
  step's first computed position up to min(KV-verified positions, known tokens - 1). A prefill
  chunk thus feeds its prompt pairs, a plain decode one pair, a verification step the bonus
  input plus the accepted drafts (the rejected tail's features are never used). Each pair lands
  at head position p in the head's private KV cache (one contiguous run of blocks per batch
  row, row_kv.py), overwriting whatever the head wrote there for its own earlier drafts, so
  rejected drafts need no rollback. The output g at the newest pair p = N-2 (N known tokens)
  is kept per row: it is what the next draft comes from.
- `propose` draws draft 1 from the head's logits at that g (draft_sampler.py: greedy or
  sampled), then runs the head K-1 more times on (draft, g) at positions N-1, N, ..., the
  drafts staying on the device until the proposal is complete (no host sync in the loop).

Positions the target never computed for this request (a prefix-cache hit, KV received from a
prefill worker) have no features. Before its first pair, a row's head KV there is filled from
the tokens alone (`_fill`: each pair (0, t[p+1]), a zero feature), so it never holds what an
earlier request of the row wrote into the same pool blocks. Drafts then depend on the
request's own tokens and on which of its positions the target computed, nothing else: with
sampled drafts (rejection sampling) a seeded request gives the same tokens whatever ran before
it or beside it, for a given prefix-cache hit (a cold and a warm run of the same seed may
differ, both distributed exactly as the target). Such drafts are worse than from real
features, never wrong: verification never accepts a draft the target's distribution does not
allow. The fill costs one head forward over the hit's tokens (the head's layers only), in
chunks of at most FILL_CHUNK tokens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from services.worker.attention.reference import AttentionMetadata
from services.worker.attention.select import TritonAttentionMetadata
from services.worker.models.base import CausalLM
from services.worker.runner.input_batch import InputBatch
from services.worker.spec.draft_sampler import DraftSampler, upload_ints
from services.worker.spec.row_kv import RowKV
from services.worker.spec.vocab_map import draft_vocab_map
from shared.model.config import ModelConfig

if TYPE_CHECKING:
    from services.worker.accel.draft_graphs import DraftGraphs
    from services.worker.accel.observe_graphs import HeadObserveGraphs

#: the most head positions one forward of `FeatureDrafter._fill` covers
FILL_CHUNK = 2048


def verified_spans(
    batch: InputBatch, rows: np.ndarray, query_lens: np.ndarray, seq_lens: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
    """What a step makes available to a drafter fed the target's features: per row, positions
    [start, end) from the step's first computed position up to min(KV-verified positions,
    known tokens - 1), for the rows with any. (rows, starts, ends, their flat-batch indices
    concatenated), or None."""
    flat_starts = np.cumsum(query_lens) - query_lens
    starts = seq_lens - query_lens
    ends = np.minimum(batch.num_computed_tokens[rows], batch.num_tokens[rows] - 1)
    keep = np.flatnonzero(ends > starts)
    if not keep.size:
        return None
    rows, starts, ends, flat_starts = rows[keep], starts[keep], ends[keep], flat_starts[keep]
    flat = np.concatenate(
        [np.arange(f, f + n) for f, n in zip(flat_starts, ends - starts, strict=True)]
    )
    return rows, starts, ends, flat


class FeatureHead(Protocol):
    """What the loop needs from a head (eagle.py, eagle3.py, mtp.py)."""

    @property
    def kv_config(self) -> ModelConfig:
        """The head's attention layers, for its private KV cache."""
        ...

    @property
    def hidden_size(self) -> int:
        """Width of g."""
        ...

    @property
    def draft_vocab_size(self) -> int:
        """0: the target's vocabulary."""
        ...

    def target_features(self, hidden: torch.Tensor, aux: torch.Tensor | None) -> torch.Tensor:
        """The head's feature input [T, H] from the target's outputs of a step."""
        ...

    def embed(self, token_ids: torch.Tensor, target: CausalLM) -> torch.Tensor: ...

    def __call__(
        self,
        embeds: torch.Tensor,
        features: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata | TritonAttentionMetadata,
        kv_caches: list[torch.Tensor],
        step: int = 0,
    ) -> torch.Tensor:
        """g [T, H] at head positions [T]; `step` = which draft of a proposal (0 in observe)."""
        ...

    def draft_logits(self, g: torch.Tensor, target: CausalLM, step: int = 0) -> torch.Tensor:
        """Logits over the draft vocabulary [R, V] from outputs g [R, H] of draft `step`."""
        ...


class FeatureDrafter:
    def __init__(
        self,
        head: FeatureHead,
        target: CausalLM,
        target_vocab_size: int,
        max_num_reqs: int,
        max_model_len: int,
        block_size: int = 16,
        d2t: torch.Tensor | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        self.head = head
        self.target = target
        self.device = torch.device(device)
        draft_vocab = head.draft_vocab_size or target.config.vocab_size
        self.vocab_map = draft_vocab_map(target_vocab_size, draft_vocab, d2t)
        dtype = next(target.parameters()).dtype
        self.kv = RowKV(head.kv_config, max_num_reqs, max_model_len, block_size, dtype, self.device)
        # Per row: the head's output at its newest pair, valid while the row holds `ready_req`
        # with `ready_len` known tokens (any other state proposes nothing). One more row, which
        # the pad rows of a captured observe write (accel/observe_graphs.py).
        self.last = torch.zeros(max_num_reqs + 1, head.hidden_size, dtype=dtype, device=device)
        self.ready_req: list[str | None] = [None] * max_num_reqs
        self.ready_len = np.full(max_num_reqs, -1, dtype=np.int64)
        # On CUDA, the draft loop and observe's head forward captured per batch size (the
        # runner sets them after capture)
        self.graphs: DraftGraphs | None = None
        self.observe_graphs: HeadObserveGraphs | None = None

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
        """Feed the head the pairs of this step's rows; `hidden` [T, H] (and `aux`, the target's
        auxiliary layer states, when the head reads them) in flat-batch order (rows,
        query_lens, seq_lens as the step ran them)."""
        spans = verified_spans(batch, rows, query_lens, seq_lens)
        if spans is None:
            return
        rows, starts, ends, flat = spans
        graphs = self.observe_graphs
        if graphs is not None and graphs.takes(batch, rows, starts, ends):
            counts = ends - starts
            graphs.run(batch, hidden, aux, rows, starts, ends, flat[np.cumsum(counts) - counts])
        else:
            self._observe_eagerly(batch, hidden, aux, rows, starts, ends, flat)
        self.kv.written[rows] = ends
        at_newest = ends == batch.num_tokens[rows] - 1
        for i, row in enumerate(rows.tolist()):
            if at_newest[i]:
                self.ready_req[row] = batch.row_req[row]
                self.ready_len[row] = batch.num_tokens[row]
            else:
                self.ready_req[row] = None

    def _observe_eagerly(
        self,
        batch: InputBatch,
        hidden: torch.Tensor,
        aux: torch.Tensor | None,
        rows: np.ndarray,
        starts: np.ndarray,
        ends: np.ndarray,
        flat: np.ndarray,
    ) -> None:
        """`observe`'s head forward run from Python: any step (prefill chunks, fills)."""
        tokens = np.concatenate(
            [batch.token_ids[r, s + 1 : e + 1] for r, s, e in zip(rows, starts, ends, strict=True)]
        )
        index = upload_ints(flat, hidden.device)
        features = self.head.target_features(hidden[index], aux[index] if aux is not None else None)
        written = self.kv.written  # head positions holding pairs of the row's request
        for i in np.flatnonzero(written[rows] < starts).tolist():  # first pairs after a hit
            self._fill(batch, int(rows[i]), int(written[rows[i]]), int(starts[i]), features)
        g = self._forward(rows, starts, ends, upload_ints(tokens, self.device), features)
        newest = np.flatnonzero(ends == batch.num_tokens[rows] - 1)
        if newest.size:
            self.last[upload_ints(rows[newest], self.device)] = g[upload_ints(newest, self.device)]

    def release(self, row: int) -> None:
        """The row's request left the batch: its head KV is free."""
        self.kv.release(row)
        self.ready_req[row] = None

    def _fill(self, batch: InputBatch, row: int, start: int, end: int, like: torch.Tensor) -> None:
        """Head positions [start, end) of `row`, which the target computed no features for:
        pairs (zero feature, t[p+1]), in chunks (`like`: a feature tensor, for width and
        dtype)."""
        rows = np.array([row], dtype=np.int64)
        for lo in range(start, end, FILL_CHUNK):
            hi = min(lo + FILL_CHUNK, end)
            tokens = upload_ints(batch.token_ids[row, lo + 1 : hi + 1], self.device)
            zeros = like.new_zeros((hi - lo, like.shape[1]))
            self._forward(rows, np.array([lo]), np.array([hi]), tokens, zeros)

    def ready(self, batch: InputBatch, row: int) -> bool:
        """The row's kept output stands for its current tokens (a proposal can start)."""
        return (
            self.ready_req[row] == batch.row_req[row]
            and self.ready_len[row] == (batch.num_tokens[row])
        )

    @torch.inference_mode()
    def propose(self, batch: InputBatch, draws: DraftSampler) -> None:
        """Draw `draws.ks[i]` drafts for each row of `draws` (all ready, every k > 0): one
        replay of the captured loop when every row drafts K, else eagerly."""
        if self.graphs is not None and self.graphs.takes(draws):
            self.graphs.run(batch, draws)
            return
        rows, ks = draws.rows, draws.ks
        g = self.last[upload_ints(rows, self.device)]
        for j in range(int(ks.max())):
            drawn = np.flatnonzero(ks > j)
            draws.draw(self.head.draft_logits(g, self.target, j), drawn)
            more = np.flatnonzero(ks[drawn] > j + 1)  # within `drawn`
            if not more.size:
                break
            index = upload_ints(more, self.device)
            pos = batch.num_tokens[rows[drawn[more]]] - 1 + j  # head position of (draft, g)
            g = self._forward(
                rows[drawn[more]], pos, pos + 1, draws.tokens[-1][index], g[index], step=j + 1
            )

    def _forward(
        self,
        rows: np.ndarray,
        starts: np.ndarray,
        ends: np.ndarray,
        tokens: torch.Tensor,
        features: torch.Tensor,
        step: int = 0,
    ) -> torch.Tensor:
        """The head over head positions [start, end) of each row (tokens/features on the
        device, concatenated row after row); its output g at each row's last position, [R, H]
        in `rows` order."""
        counts = ends - starts
        order = np.argsort(counts != 1, kind="stable")  # single tokens first (decode path)
        offsets = np.cumsum(counts) - counts
        perm = np.concatenate([np.arange(offsets[i], offsets[i] + counts[i]) for i in order])
        rows_o, starts_o, ends_o, counts_o = rows[order], starts[order], ends[order], counts[order]
        positions = np.concatenate([np.arange(s, e) for s, e in zip(starts_o, ends_o, strict=True)])
        attn = self.kv.metadata(rows_o, ends_o, counts_o, positions)
        perm_t = upload_ints(perm, self.device)
        g = self.head(
            self.head.embed(tokens[perm_t], self.target),
            features[perm_t],
            upload_ints(positions, self.device),
            attn,
            self.kv.layers,
            step,
        )
        last_o = np.cumsum(counts_o) - 1
        unorder = np.argsort(order)  # ordered index of each original row
        return g[upload_ints(last_o[unorder], self.device)]
