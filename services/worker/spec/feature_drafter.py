"""EAGLE drafting in the worker: the head (eagle.py) fed the target's features, K greedy drafts.

Two calls per step, both after the target's sampling/verification:

- `observe` runs the head over every pair (f[p], t[p+1]) the step made available: p from the
  step's first computed position up to min(KV-verified positions, known tokens - 1). A prefill
  chunk thus feeds its prompt pairs, a plain decode one pair, a verification step the bonus
  input plus the accepted drafts (the rejected tail's features are never used). Each pair lands
  at head position p in the head's private KV cache (one contiguous run of blocks per batch row,
  as draft_model.py does), overwriting whatever the head wrote there for its own earlier drafts,
  so rejected drafts need no rollback. The output g at the newest pair p = N-2 (N known tokens)
  is kept per row: it is what the next draft comes from.
- `propose` turns that g into draft 1 (argmax of the target's lm_head, or the head's own
  lm_head through the vocabulary map), then runs the head K-1 more times on (g, draft) at
  positions N-1, N, ... (EAGLE feeds its own output back as the next feature).

Positions the target never computed for this request (a prefix-cache hit, KV received from a
prefill worker) have no features, so the head's KV there is stale: drafts get worse, never
wrong, because verification accepts a draft only if it equals the target's own draw.
"""

from __future__ import annotations

import numpy as np
import torch

from services.worker.models.base import CausalLM
from services.worker.runner.input_batch import InputBatch
from services.worker.spec.eagle import EagleHead
from services.worker.spec.row_kv import RowKV
from services.worker.spec.vocab_map import draft_vocab_map, to_target_ids


class EagleDrafter:
    def __init__(
        self,
        head: EagleHead,
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
        dtype = next(head.parameters()).dtype
        self.kv = RowKV(head.config, max_num_reqs, max_model_len, block_size, dtype, self.device)
        # Per row: the head's output at its newest pair, valid while the row holds `ready_req`
        # with `ready_len` known tokens (any other state proposes nothing).
        self.last = torch.zeros(max_num_reqs, head.config.hidden_size, dtype=dtype, device=device)
        self.ready_req: list[str | None] = [None] * max_num_reqs
        self.ready_len = np.full(max_num_reqs, -1, dtype=np.int64)

    @torch.inference_mode()
    def observe(
        self,
        batch: InputBatch,
        hidden: torch.Tensor,
        rows: np.ndarray,
        query_lens: np.ndarray,
        seq_lens: np.ndarray,
    ) -> None:
        """Feed the head the pairs of this step's rows; `hidden` [T, H] is the target's
        output in flat-batch order (rows, query_lens, seq_lens as the step ran them)."""
        flat_starts = np.cumsum(query_lens) - query_lens
        starts = seq_lens - query_lens
        ends = np.minimum(batch.num_computed_tokens[rows], batch.num_tokens[rows] - 1)
        keep = np.flatnonzero(ends > starts)
        if not keep.size:
            return
        rows, starts, ends, flat_starts = rows[keep], starts[keep], ends[keep], flat_starts[keep]
        counts = ends - starts
        flat = np.concatenate(
            [np.arange(f, f + n) for f, n in zip(flat_starts, counts, strict=True)]
        )
        tokens = np.concatenate(
            [batch.token_ids[r, s + 1 : e + 1] for r, s, e in zip(rows, starts, ends, strict=True)]
        )
        features = hidden[torch.from_numpy(flat).to(hidden.device)]
        g = self._forward(rows, starts, ends, tokens, features)
        for i, row in enumerate(rows.tolist()):
            if ends[i] == batch.num_tokens[row] - 1:
                self.last[row] = g[i]
                self.ready_req[row] = batch.row_req[row]
                self.ready_len[row] = batch.num_tokens[row]
            else:
                self.ready_req[row] = None

    @torch.inference_mode()
    def propose(self, batch: InputBatch, rows: np.ndarray, ks: list[int]) -> list[list[int]]:
        """Greedy drafts for each row (`ks[i]` of them, 0 = none)."""
        active = [
            (int(r), k)
            for r, k in zip(rows.tolist(), ks, strict=True)
            if k > 0
            and self.ready_req[r] == batch.row_req[r]
            and self.ready_len[r] == batch.num_tokens[r]
        ]
        out: dict[int, list[int]] = {r: [] for r, _ in active}
        rows_a = np.array([r for r, _ in active], dtype=np.int64)
        k_a = np.array([k for _, k in active], dtype=np.int64)
        g = self.last[torch.from_numpy(rows_a).to(self.device)] if active else None
        for j in range(int(k_a.max()) if active else 0):
            assert g is not None
            ids = self._draft_ids(g)
            for row, token in zip(rows_a.tolist(), ids.tolist(), strict=True):
                out[row].append(int(token))
            more = np.flatnonzero(k_a > j + 1)
            if not more.size:
                break
            rows_a, k_a = rows_a[more], k_a[more]
            pos = batch.num_tokens[rows_a] - 1 + j  # head position of the pair (g, draft j+1)
            index = torch.from_numpy(more).to(self.device)
            g = self._forward(rows_a, pos, pos + 1, ids[index].cpu().numpy(), g[index])
        return [out.get(int(r), []) for r in rows.tolist()]

    def _draft_ids(self, g: torch.Tensor) -> torch.Tensor:
        """Target token ids of the greedy next token from head outputs g [R, H]."""
        if self.head.lm_head is not None:
            return to_target_ids(self.head.own_logits(g).argmax(-1), self.vocab_map)
        return self.target.compute_logits(g).argmax(-1)

    def _forward(
        self,
        rows: np.ndarray,
        starts: np.ndarray,
        ends: np.ndarray,
        tokens: np.ndarray,
        features: torch.Tensor,
    ) -> torch.Tensor:
        """The head over head positions [start, end) of each row (tokens/features concatenated
        row after row); its output g at each row's last position, [R, H] in `rows` order."""
        counts = ends - starts
        order = np.argsort(counts != 1, kind="stable")  # single tokens first (decode path)
        offsets = np.cumsum(counts) - counts
        perm = np.concatenate([np.arange(offsets[i], offsets[i] + counts[i]) for i in order])
        rows_o, starts_o, ends_o, counts_o = rows[order], starts[order], ends[order], counts[order]
        positions = np.concatenate([np.arange(s, e) for s, e in zip(starts_o, ends_o, strict=True)])
        attn = self.kv.metadata(rows_o, ends_o, counts_o, positions)
        ids = torch.from_numpy(tokens[perm].astype(np.int64)).to(self.device)
        embed = getattr(self.target, "embed", self.target.embed_tokens)
        g = self.head(
            embed(ids),
            features[torch.from_numpy(perm).to(features.device)],
            torch.from_numpy(positions.astype(np.int64)).to(self.device),
            attn,
            self.kv.layers,
        )
        last_o = np.cumsum(counts_o) - 1
        unorder = np.argsort(order)  # ordered index of each original row
        return g[torch.from_numpy(last_o[unorder]).to(self.device)]
