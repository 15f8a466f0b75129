"""Drawing one proposal's drafts from a drafter's logits: greedy at temperature 0, sampled with
the request's temperature and seed otherwise, keeping q for verification.

Draft j of a row is drawn at position base + j + 2^30 (draws.py): Gumbel-max over the draft's
logits / T, a draw from q = softmax(logits / T) whatever else is in the batch. Rows at
temperature 0 take the argmax (a point mass: verified by the same-noise rule, verify.py); rows
at temperature > 0 keep q over the target vocabulary for rejection sampling. Only the request's
temperature shapes q: truncation, bias and grammar belong to the target's p, and a draft they
forbid is simply rejected (p = 0 there).

A draft vocabulary smaller than the target's (vocab_map.py) is drawn in its own ids, noise keyed
by the draft id; q then holds zeros on the target tokens the drafter cannot propose. Everything
stays on the device: the draft loops feed these tokens back without a host sync, and the host
reads all drafts once, at the end of the proposal.
"""

from __future__ import annotations

import numpy as np
import torch

from meshllm_kernels.runtime.staged_copy import stage_to_device
from services.worker.runner.input_batch import InputBatch
from services.worker.sampling.state import GREEDY_TEMPERATURE, SamplingState
from services.worker.spec.draws import DRAFT_POSITION_SALT, gumbel_draw
from services.worker.spec.proposals import Proposal
from services.worker.spec.vocab_map import to_target_ids


class DraftSampler:
    """The draws of one proposal for `rows` (batch rows, each with `ks[i]` drafts to make)."""

    def __init__(
        self,
        sampler: SamplingState,
        batch: InputBatch,
        rows: np.ndarray,
        ks: np.ndarray,
        target_vocab_size: int,
        vocab_map: torch.Tensor | None = None,
    ) -> None:
        self.device = sampler.device
        self.rows = np.asarray(rows, dtype=np.int64)
        self.ks = np.asarray(ks, dtype=np.int64)
        self.base = batch.num_tokens[self.rows].copy()
        self.request_ids = [batch.row_req[r] for r in self.rows.tolist()]
        params = [batch.sampling[r] for r in self.rows.tolist()]
        self.random = np.array(
            [p is not None and p.temperature >= GREEDY_TEMPERATURE for p in params], dtype=bool
        )
        state = self._to_device(self.rows)
        self.inv_temperature = sampler.inv_temperature[state]
        self.seeds = sampler.seed[state]
        self.vocab_map = vocab_map.to(self.device) if vocab_map is not None else None
        max_k = int(self.ks.max()) if self.ks.size else 0
        # q of every (row, draft) over the target vocabulary; only random rows' entries are read
        self.q = (
            torch.zeros(len(self.rows), max_k, target_vocab_size, device=self.device)
            if self.random.any() and max_k
            else None
        )
        self.tokens: list[torch.Tensor] = []  # target ids of draft j, [rows with k > j]
        self.index: list[np.ndarray] = []  # positions in `rows` of draft j's entries

    def draw(self, logits: torch.Tensor, index: np.ndarray) -> torch.Tensor:
        """Draft j (j = the number of earlier calls) for the rows at positions `index` of
        `rows`, from their logits [len(index), V] in the drafter's vocabulary. Returns the
        drafts in the drafter's own ids (its next input); keeps them as target ids."""
        j = len(self.tokens)
        at = self._to_device(index)
        inv_temperature = self.inv_temperature[at]
        positions = self._to_device(self.base[index] + j + DRAFT_POSITION_SALT)
        ids = gumbel_draw(logits, inv_temperature, self.seeds[at], positions)
        if self.q is not None and self.random[index].any():
            scale = torch.where(inv_temperature == 0, 1.0, inv_temperature)
            probs = torch.softmax(logits.float() * scale.unsqueeze(1), dim=-1)
            if self.vocab_map is None:
                self.q[at, j] = probs
            else:
                self.q[at.unsqueeze(1), j, self.vocab_map.unsqueeze(0)] = probs
        self.tokens.append(to_target_ids(ids, self.vocab_map))
        self.index.append(np.asarray(index, dtype=np.int64))
        return ids

    def take(self, tokens: torch.Tensor, q: torch.Tensor) -> None:
        """Every row's next drafts at once, from a captured draft loop (accel/draft_graphs.py):
        `tokens` [J, rows] as target ids, `q` [rows, J, V] (only the rows at temperature > 0
        are kept); the same proposal as J `draw` calls over all rows."""
        first = len(self.tokens)
        everyone = np.arange(len(self.rows), dtype=np.int64)
        for j in range(tokens.shape[0]):
            self.tokens.append(tokens[j])
            self.index.append(everyone)
        if self.q is not None:
            self.q[:, first : first + tokens.shape[0]].copy_(q[:, : tokens.shape[0]])

    def drafts(self) -> list[list[int]]:
        """Every row's drafts as target ids (one copy to the host, after the loop)."""
        out: list[list[int]] = [[] for _ in self.rows]
        if not self.tokens:
            return out
        host = torch.cat(self.tokens).cpu().tolist()
        start = 0
        for index in self.index:
            for pos in index.tolist():
                out[pos].append(int(host[start]))
                start += 1
        return out

    def proposals(self, drafts: list[list[int]]) -> list[Proposal]:
        """One proposal per row (q for the rows at temperature > 0)."""
        out = []
        for i, row_drafts in enumerate(drafts):
            q = None
            if self.q is not None and self.random[i]:
                q = self.q[i, : len(row_drafts)]
            request_id = self.request_ids[i] or ""
            out.append(Proposal(request_id, int(self.base[i]), row_drafts, q))
        return out

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        return upload_ints(array, self.device)


def upload_ints(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """int64 host data on `device` without a host sync (staged through pinned memory on CUDA:
    a pageable upload would wait for the queued work, CONTRACTS.md)."""
    return stage_to_device(np.ascontiguousarray(array, dtype=np.int64), device)
