"""A separate draft model sharing the target's tokenizer: drafts from a small CausalLM.

The draft keeps its own KV cache, private to the worker (row_kv.py: blocks per batch row from a
pool of its own), so the draft may write positions past the request's verified tokens (its own
speculative steps) without slots from the scheduler, and never touches the target's cache. Per
row it remembers how many verified tokens its KV covers; each proposal first catches up on the
tokens verified since (a short span: the accepted drafts and the bonus), then decodes K - 1
more tokens. KV the draft wrote for its own proposals is never
trusted later: the catch-up recomputes from the last verified position, so a rejection needs no
rollback here.

Drafts are drawn by draft_sampler.py (greedy at temperature 0, sampled with the request's seed
otherwise) and stay on the device through the loop. A draft vocabulary smaller than the
target's reaches the target through the vocabulary map (vocab_map.py); verified tokens go back
into the draft through its inverse.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from services.worker.models.base import CausalLM
from services.worker.runner.input_batch import InputBatch
from services.worker.spec.draft_sampler import DraftSampler, upload_ints
from services.worker.spec.row_kv import RowKV
from services.worker.spec.vocab_map import draft_vocab_map, to_draft_table

if TYPE_CHECKING:
    from services.worker.accel.draft_graphs import DraftModelGraphs


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
        self.to_draft = to_draft_table(self.vocab_map, target_vocab_size)
        dtype = next(model.parameters()).dtype
        self.kv = RowKV(model.config, max_num_reqs, max_model_len, block_size, dtype, self.device)
        self.owner: list[str | None] = [None] * max_num_reqs
        # On CUDA, the K - 1 decode steps after the first draw captured per batch size (the
        # runner sets it after capture)
        self.graphs: DraftModelGraphs | None = None

    def release(self, row: int) -> None:
        """The row's request left the batch: its draft KV is free."""
        self.kv.release(row)
        self.owner[row] = None

    @torch.inference_mode()
    def propose(self, batch: InputBatch, draws: DraftSampler) -> None:
        """Draw `draws.ks[i]` drafts for each row of `draws` (every k > 0)."""
        rows, ks = draws.rows, draws.ks
        for row in rows.tolist():
            if self.owner[row] != batch.row_req[row]:  # a new request in this row
                self.release(row)
                self.owner[row] = batch.row_req[row]
        # Catch up on the verified tokens; the last one's logits give draft 1.
        ends = batch.num_tokens[rows]
        starts = np.minimum(self.kv.written[rows], ends - 1)  # verified tokens in draft KV
        tokens = np.concatenate(
            [batch.token_ids[r, s:e] for r, s, e in zip(rows.tolist(), starts, ends, strict=True)]
        )
        if self.to_draft is not None:
            tokens = self.to_draft[tokens]
        flat = upload_ints(tokens, self.device)
        logits = self._step(rows, starts, ends, flat)
        self.kv.written[rows] = ends
        ids = draws.draw(logits, np.arange(len(rows)))
        if self.graphs is not None and self.graphs.takes(draws):  # every row drafts K
            self.graphs.run_after_first(batch, draws, ids)
            return
        for j in range(1, int(ks.max())):
            more = np.flatnonzero(ks > j)
            if not more.size:
                break
            # Feed each remaining row's draft j - 1 at its position (draft KV only).
            pos = ends[more] + j - 1
            keep = upload_ints(np.flatnonzero(ks[ks > j - 1] > j), self.device)
            logits = self._step(rows[more], pos, pos + 1, ids[keep])
            ids = draws.draw(logits, more)

    def _step(
        self, rows: np.ndarray, starts: np.ndarray, ends: np.ndarray, tokens: torch.Tensor
    ) -> torch.Tensor:
        """One draft forward over positions [start, end) of each row (`tokens` flat, row after
        row, on the device); the logits at each row's end, [R, V] in `rows` order."""
        counts = ends - starts
        order = np.argsort(counts != 1, kind="stable")  # single tokens first (decode path)
        offsets = np.cumsum(counts) - counts
        perm = np.concatenate([np.arange(offsets[i], offsets[i] + counts[i]) for i in order])
        rows_o, ends_o, counts_o = rows[order], ends[order], counts[order]
        positions = np.concatenate(
            [np.arange(s, e) for s, e in zip(starts[order], ends_o, strict=True)]
        )
        attn = self.kv.metadata(rows_o, ends_o, counts_o, positions)
        hidden = self.model(
            tokens[upload_ints(perm, self.device)],
            upload_ints(positions, self.device),
            attn,
            self.kv.layers,
        )
        last = np.cumsum(counts_o) - 1
        unorder = np.argsort(order)
        logits: torch.Tensor = self.model.compute_logits(
            hidden[upload_ints(last[unorder], self.device)]
        )
        return logits
