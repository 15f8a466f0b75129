"""A separate draft model sharing the target's tokenizer: greedy drafts from a small CausalLM.

The draft keeps its own KV cache, private to the worker: each batch row owns a contiguous run
of draft blocks covering max_model_len, so the draft may write positions past the request's
verified tokens (its own speculative steps) without slots from the scheduler, and never
touches the target's cache. Per row it remembers how many verified tokens its KV covers; each
proposal first catches up on the tokens verified since (a short span: the accepted drafts and
the bonus), then decodes K - 1 more tokens. KV the draft wrote for its own proposals is never
trusted later: the catch-up recomputes from the last verified position, so a rejection needs no
rollback here.

Drafts are greedy (the draft's argmax). The verification (verify.py) accepts a draft iff it
equals the target's own draw, which is exact for any drafter, at any temperature; with a draft
distribution q that is not a point mass this accepts less than min(1, p/q) rejection sampling
would (not implemented), never wrongly. Draft ids pass through the vocabulary map
(vocab_map.py) when the draft's vocabulary is smaller than the target's.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from services.worker.models.base import CausalLM
from services.worker.runner.input_batch import InputBatch
from services.worker.spec.row_kv import RowKV
from services.worker.spec.vocab_map import draft_vocab_map, to_target_ids


def load_d2t(model_dir: str | Path) -> torch.Tensor | None:
    """The checkpoint's draft->target offsets (EAGLE-3's `d2t`), if it has them."""
    from safetensors import safe_open

    for file in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            if "d2t" in f.keys():  # noqa: SIM118 - safe_open has no __contains__
                return f.get_tensor("d2t")
    return None


class DraftModelDrafter:
    def __init__(
        self,
        model: CausalLM,
        target_vocab_size: int,
        num_spec_tokens: int,
        max_num_reqs: int,
        max_model_len: int,
        block_size: int = 16,
        d2t: torch.Tensor | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        self.model = model
        self.k = num_spec_tokens
        self.device = torch.device(device)
        self.vocab_map = draft_vocab_map(target_vocab_size, model.config.vocab_size, d2t)
        dtype = next(model.parameters()).dtype
        self.kv = RowKV(model.config, max_num_reqs, max_model_len, block_size, dtype, self.device)
        self.computed = np.zeros(max_num_reqs, dtype=np.int64)  # verified tokens in draft KV
        self.owner: list[str | None] = [None] * max_num_reqs

    @torch.inference_mode()
    def propose(self, batch: InputBatch, rows: np.ndarray, ks: list[int]) -> list[list[int]]:
        """Greedy drafts for each row (`ks[i]` of them, 0 = none)."""
        active = [(int(r), k) for r, k in zip(rows.tolist(), ks, strict=True) if k > 0]
        out: dict[int, list[int]] = {r: [] for r, _ in active}
        if not active:
            return [[] for _ in ks]
        for row, _ in active:
            if self.owner[row] != batch.row_req[row]:  # a new request in this row
                self.owner[row] = batch.row_req[row]
                self.computed[row] = 0
        # Catch up on the verified tokens; the last one's logits give draft 1.
        starts = np.array([min(self.computed[r], batch.num_tokens[r] - 1) for r, _ in active])
        ends = np.array([batch.num_tokens[r] for r, _ in active])
        tokens = np.concatenate(
            [batch.token_ids[r, s:e] for (r, _), s, e in zip(active, starts, ends, strict=True)]
        )
        next_ids = self._step([r for r, _ in active], starts, ends, tokens)
        for (row, _), end in zip(active, ends, strict=True):
            self.computed[row] = end
        current = list(zip([r for r, _ in active], ends.tolist(), next_ids, strict=True))
        for j in range(max(k for _, k in active)):
            still = []
            for (row, pos, token), (_, k) in zip(current, active, strict=True):
                out[row].append(token)
                if j + 1 < k:
                    still.append((row, pos, token))
            if not still:
                break
            # Decode each remaining row's newest draft at its position (draft KV only).
            rs = [r for r, _, _ in still]
            pos = np.array([p for _, p, _ in still])
            ids = self._step(rs, pos, pos + 1, np.array([t for _, _, t in still]))
            current = [(r, p + 1, t) for (r, p, _), t in zip(still, ids, strict=True)]
            active = [(r, k) for r, k in active if r in set(rs)]
        result: list[list[int]] = []
        for row, k in zip(rows.tolist(), ks, strict=True):
            drafts = out.get(int(row), [])[:k]
            if self.vocab_map is not None:
                drafts = to_target_ids(torch.tensor(drafts), self.vocab_map).tolist()
            result.append(drafts)
        return result

    def _step(
        self, rows: list[int], starts: np.ndarray, ends: np.ndarray, tokens: np.ndarray
    ) -> list[int]:
        """One draft forward over positions [start, end) of each row; argmax at each end."""
        counts = ends - starts
        order = np.argsort(counts != 1, kind="stable")  # single tokens first (decode path)
        rows_o, starts_o, ends_o = [rows[i] for i in order], starts[order], ends[order]
        offsets = np.concatenate(([0], np.cumsum(counts)[:-1]))
        flat = np.concatenate([tokens[offsets[i] : offsets[i] + counts[i]] for i in order])
        counts_o = counts[order]
        positions = np.concatenate([np.arange(s, e) for s, e in zip(starts_o, ends_o, strict=True)])
        attn = self.kv.metadata(np.array(rows_o), ends_o, counts_o, positions)
        hidden = self.model(
            torch.from_numpy(flat.astype(np.int64)).to(self.device),
            torch.from_numpy(positions.astype(np.int64)).to(self.device),
            attn,
            self.kv.layers,
        )
        last = torch.from_numpy(np.cumsum(counts_o) - 1).to(self.device)
        picked = self.model.compute_logits(hidden[last]).argmax(-1).tolist()
        by_row = dict(zip(rows_o, picked, strict=True))
        return [int(by_row[r]) for r in rows]
