"""What the drafter proposed for each batch row, kept until the step that verifies it.

Sampled drafts are verified by rejection sampling, which needs the distribution q each draft
was drawn from; the scheduler only forwards token ids (StepPlan.spec_token_ids), so the worker
keeps q itself. The plan's drafts for a request are a prefix of the proposal: the scheduler
caps them (K, step budget, max_tokens, max_model_len) and trims at the first one the request's
grammar rejects. A trim that depends on the draft's value would bias sampled output (the token
after it would come from p instead of the residual), so verification also checks the first
proposed draft past the plan's ones against the step's last row (verify_step.py).

A proposal is valid for a request only while the row holds that request with the same number
of known tokens (`base`): after any other change it is ignored, and the step falls back to the
rule that needs no q (verify.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class Proposal:
    request_id: str
    base: int  # the row's known tokens when proposed: draft j is for position base + j
    drafts: list[int]
    # [len(drafts), V] float32: draft j's distribution over the target vocabulary, for drafts
    # drawn at temperature > 0; None for point masses (n-gram, greedy)
    q: torch.Tensor | None = None


class ProposalBook:
    """One proposal per batch row (replaced by each new proposal for the row)."""

    def __init__(self, max_num_reqs: int) -> None:
        self._rows: list[Proposal | None] = [None] * max_num_reqs
        self._sampled = 0  # rows holding a proposal with q

    def put(self, row: int, proposal: Proposal | None) -> None:
        self.drop(row)
        if proposal is not None and proposal.drafts:
            self._rows[row] = proposal
            self._sampled += proposal.q is not None

    def drop(self, row: int) -> None:
        old = self._rows[row]
        if old is not None:
            self._sampled -= old.q is not None
            self._rows[row] = None

    @property
    def has_sampled(self) -> bool:
        """Some row holds sampled drafts (a step must run the verification path for them)."""
        return self._sampled > 0

    def current(self, row: int, request_id: str | None, base: int) -> Proposal | None:
        """The row's proposal if it stands for `request_id` at `base` known tokens, else None
        (the drafts the worker verifies in a plan's lookahead slots: StepPlan.spec_lookahead)."""
        proposal = self._rows[row]
        if proposal is None or proposal.request_id != request_id or proposal.base != base:
            return None
        return proposal

    def sampled_for(
        self, row: int, request_id: str | None, base: int, plan_drafts: Sequence[int]
    ) -> Proposal | None:
        """The row's sampled proposal if it stands for `request_id` at `base` known tokens and
        the plan's drafts are a prefix of it; else None."""
        proposal = self._rows[row]
        if (
            proposal is None
            or proposal.q is None
            or proposal.request_id != request_id
            or proposal.base != base
            or len(plan_drafts) > len(proposal.drafts)
            or list(plan_drafts) != proposal.drafts[: len(plan_drafts)]
        ):
            return None
        return proposal
