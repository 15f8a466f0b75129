"""Rejection sampling inside a verification step (the rule in verify.py), for the requests
whose drafts were sampled from a distribution q the worker holds (proposals.py).

verify_step.py samples the step position by position; `RejectionChecks` rides along: it says
which rows of each position it checks, keeps their target distribution p, and at the end
decides every checked row at once on the device (acceptance uniforms, residual draws), then
copies the answers to the host together (the step's tokens go to the scheduler anyway). A
checked row is row j < k of a request's drafts, plus row k when the proposal holds a draft past
the plan's (the scheduler trimmed it; proposals.py says why it is still checked).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from services.worker.sampling.state import GREEDY_TEMPERATURE, SamplerOutput
from services.worker.spec.draws import accept_uniforms, gumbel_draw
from services.worker.spec.proposals import Proposal
from services.worker.spec.verify import accept_mask, chain_tokens, residual_scores

if TYPE_CHECKING:
    from services.worker.runner.model_runner import ModelRunner


@dataclass
class Decision:
    """One request's checked rows, decided: row j's acceptance, its residual draw (and whether
    the residual has any mass) and the logprobs of the draft and of the residual draw."""

    extra: int | None
    accepted: list[bool]
    has_mass: list[bool]
    corrections: list[int]
    draft_logprobs: list[float]
    correction_logprobs: list[float]

    def tokens(
        self, drafts: list[int], plain: np.ndarray, plain_logprobs: np.ndarray
    ) -> tuple[list[int], list[float]]:
        """(the step's output tokens, each one's logprob). `plain` [k + 1]: the plain draws of
        the request's rows (the bonus, and the correction where a residual has no mass)."""
        pairs = zip(self.corrections, self.has_mass, strict=True)
        corrections = [c if mass else int(plain[j]) for j, (c, mass) in enumerate(pairs)]
        out = chain_tokens(drafts, self.accepted, corrections, int(plain[len(drafts)]), self.extra)
        logprobs = []
        for j in range(len(out)):
            if j == len(drafts) and self.extra is None:  # the bonus
                logprobs.append(float(plain_logprobs[j]))
            elif self.accepted[j]:  # a draft (or the extra one) stood
                logprobs.append(self.draft_logprobs[j])
            elif self.has_mass[j]:
                logprobs.append(self.correction_logprobs[j])
            else:
                logprobs.append(float(plain_logprobs[j]))
        return out, logprobs


class RejectionChecks:
    def __init__(self, proposals: dict[int, Proposal], num_drafts: np.ndarray) -> None:
        self.proposals = proposals  # request index (in the step's sampling order) -> proposal
        self.k = num_drafts
        self._order: list[tuple[int, int]] = []  # (request index, row j) of each kept row
        self._p: list[torch.Tensor] = []
        self._logprobs: list[torch.Tensor] = []

    @classmethod
    def find(
        cls, runner: ModelRunner, rows: np.ndarray, verified: np.ndarray, num_drafts: np.ndarray
    ) -> RejectionChecks:
        """The step's requests at temperature > 0 whose row holds a matching sampled proposal."""
        found: dict[int, Proposal] = {}
        drafter, batch = runner.drafter, runner.batch
        if drafter is not None and drafter.book.has_sampled:
            for i, (row, t, n) in enumerate(zip(rows.tolist(), verified, num_drafts, strict=True)):
                params = batch.sampling[row]
                if params is None or params.temperature < GREEDY_TEMPERATURE:
                    continue
                drafts = batch.token_ids[row, t : t + n].tolist()
                proposal = drafter.book.sampled_for(row, batch.row_req[row], int(t), drafts)
                if proposal is not None:
                    found[i] = proposal
        return cls(found, num_drafts)

    def extra(self, i: int) -> int | None:
        """The proposal's first draft past the plan's for request i, or None."""
        proposal, n = self.proposals[i], int(self.k[i])
        return proposal.drafts[n] if len(proposal.drafts) > n else None

    def rows_at(self, j: int, sel: np.ndarray) -> np.ndarray:
        """Positions within `sel` (the requests sampled at row j) whose row j is checked; the
        next `collect` keeps their p in this order."""
        picked = [
            (pos, i)
            for pos, i in enumerate(sel.tolist())
            if i in self.proposals and (j < self.k[i] or self.extra(i) is not None)
        ]
        self._order += [(i, j) for _, i in picked]
        return np.array([pos for pos, _ in picked], dtype=np.int64)

    def collect(self, out: SamplerOutput, checked: np.ndarray, runner: ModelRunner) -> None:
        """Keep p (and the logprobs) of the checked rows of one position's sampler call."""
        if not checked.size:
            return
        assert out.probs is not None
        index = runner._to_device(checked)
        self._p.append(out.probs[index])
        if out.row_logprobs is not None:
            self._logprobs.append(out.row_logprobs[index])

    def decide(
        self, runner: ModelRunner, rows: np.ndarray, verified: np.ndarray
    ) -> dict[int, Decision]:
        """Every checked row decided on the device, then the answers copied to the host."""
        if not self._order:
            return {}
        sampler = runner.sampler
        order = self._order
        p = torch.cat(self._p)
        proposals = [self.proposals[i] for i, _ in order]
        q = torch.stack([pr.q[j] for pr, (_, j) in zip(proposals, order, strict=True)])  # type: ignore[index]
        q = q.to(p.device)
        draft_ids = np.array(
            [pr.drafts[j] for pr, (_, j) in zip(proposals, order, strict=True)], dtype=np.int64
        )
        state_rows = np.array([rows[i] for i, _ in order], dtype=np.int64)
        positions = np.array([verified[i] + j for i, j in order], dtype=np.int64)
        x, at, state = (runner._to_device(a) for a in (draft_ids, positions, state_rows))
        seeds = sampler.seed[state]
        accepted = accept_mask(p, q, x, accept_uniforms(seeds, at, x))
        scores, has_mass = residual_scores(p, q)
        ones = torch.ones(len(order), dtype=torch.float32, device=p.device)
        corrections = gumbel_draw(scores, ones, seeds, at)
        tokens = torch.stack([accepted, has_mass]).cpu().numpy()
        corrected = corrections.cpu().numpy()
        token_logprobs = np.zeros((2, len(order)), dtype=np.float32)
        if self._logprobs:
            lp = torch.cat(self._logprobs)
            picked = torch.stack([x, corrections], dim=1)  # [M, 2]
            token_logprobs = lp.gather(1, picked).t().cpu().numpy()
        decided: dict[int, Decision] = {}
        for m, (i, _) in enumerate(order):
            d = decided.get(i)
            if d is None:
                d = decided[i] = Decision(self.extra(i), [], [], [], [], [])
            d.accepted.append(bool(tokens[0, m]))
            d.has_mass.append(bool(tokens[1, m]))
            d.corrections.append(int(corrected[m]))
            d.draft_logprobs.append(float(token_logprobs[0, m]))
            d.correction_logprobs.append(float(token_logprobs[1, m]))
        return decided
