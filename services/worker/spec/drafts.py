"""Drafts in the persistent batch: staging the plan's drafts, proposing the next step's.

Staging writes a request's drafts right after its verified tokens in `InputBatch.token_ids`
(positions T .. T+k-1) without counting them in `num_tokens`: they are inputs of this step's
forward, not tokens of the request. Verification then overwrites position T+a with the
correction/bonus and sets `num_tokens` to T+a+1, so rejected drafts vanish from the batch; their
KV (slots the scheduler reserved as lookahead) is overwritten by later steps before anything
attends to it, and the scheduler never registers those slots in the prefix cache.

Every sampled request is proposed for, whatever its sampling: where it reads what was output
(repetition/frequency/presence penalties, min_tokens, bad words of two tokens or more), the
verify step draws each position with the drafts before it recorded as outputs
(verify_step.py), so each position samples as plain decoding would.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from services.worker.runner.input_batch import InputBatch, PlanError
from services.worker.spec.block_drafter import BlockDrafter
from services.worker.spec.config import METHODS, SpeculativeConfig
from services.worker.spec.dflash import load_dflash_head
from services.worker.spec.draft_model import DraftModelDrafter, load_d2t
from services.worker.spec.draft_sampler import DraftSampler
from services.worker.spec.eagle import load_eagle_head
from services.worker.spec.eagle3 import load_eagle3_head
from services.worker.spec.feature_drafter import FeatureDrafter, FeatureHead
from services.worker.spec.mtp import load_mtp_head
from services.worker.spec.ngram import NgramProposer
from services.worker.spec.proposals import Proposal, ProposalBook
from shared.protocol import StepPlan

if TYPE_CHECKING:
    from services.worker.models.base import CausalLM
    from services.worker.sampling.state import SamplingState


def step_drafts(
    plan: StepPlan,
    book: ProposalBook | None,
    batch: InputBatch,
    request_ids: list[str],
    rows: np.ndarray,
    counts: np.ndarray,
) -> dict[str, Sequence[int]]:
    """The drafts this step verifies, per request: the plan's (StepPlan.spec_token_ids) and,
    for a request given lookahead slots (StepPlan.spec_lookahead), the worker's own proposal
    for its current tokens, cut to the slots and to max_tokens (the scheduler plans the slots
    before it knows how many earlier drafts were accepted). Such a request's scheduled tokens
    (`counts`, 1 + slots) shrink to 1 + the drafts it has, or to 0 when its tokens already
    reached max_tokens (the scheduler finishes it on an earlier result; its KV reaches no
    further). PlanError if its slots and scheduled tokens disagree."""
    drafts: dict[str, Sequence[int]] = dict(plan.spec_token_ids)
    if not plan.spec_lookahead:
        return drafts
    for i, request_id in enumerate(request_ids):
        slots = plan.spec_lookahead.get(request_id)
        if slots is None:
            continue
        if slots < 0 or counts[i] != 1 + slots or request_id in drafts:
            raise PlanError(
                f"{request_id}: {slots} lookahead slots with {int(counts[i])} tokens scheduled"
                f"{' and drafts' if request_id in drafts else ''}"
            )
        row = int(rows[i])
        num_tokens = int(batch.num_tokens[row])
        params = batch.sampling[row]
        room = slots
        if params is not None:
            left = params.max_tokens - (num_tokens - int(batch.num_prompt_tokens[row]))
            if left <= 0:  # max_tokens reached: its last result finishes it
                counts[i] = 0
                continue
            room = min(slots, left - 1)  # drafts, then the bonus token
        proposal = book.current(row, request_id, num_tokens) if book else None
        own = proposal.drafts[:room] if proposal is not None else []
        if own:
            drafts[request_id] = own
        counts[i] = 1 + len(own)
    return drafts


def stage_drafts(
    batch: InputBatch, drafts: Mapping[str, Sequence[int]], request_ids: list[str], rows: np.ndarray
) -> np.ndarray:
    """Write the step's drafts for the listed requests into the batch; returns the draft count
    per request (0 for requests without drafts). PlanError if drafts do not fit the row."""
    counts = np.zeros(len(request_ids), dtype=np.int64)
    for i, request_id in enumerate(request_ids):
        drafts_i = drafts.get(request_id)
        if not drafts_i:
            continue
        row = int(rows[i])
        start = int(batch.num_tokens[row])
        end = start + len(drafts_i)
        if end >= batch.max_model_len:
            raise PlanError(
                f"{request_id}: {len(drafts_i)} drafts after {start} tokens leave no room for "
                f"the bonus token within max_model_len={batch.max_model_len}"
            )
        batch.token_ids[row, start:end] = drafts_i
        counts[i] = len(drafts_i)
    return counts


class Drafter:
    """Proposes each sampled request's drafts for the next step and keeps the proposals until
    they are verified (proposals.py): prompt lookup ("ngram"), a separate draft model
    ("draft", draft_model.py), a head fed the target's features ("eagle", "eagle3", "mtp":
    feature_drafter.py with eagle.py / eagle3.py / mtp.py; needs `target`), or a DFlash draft
    that drafts the whole block in one non-causal forward ("dflash": block_drafter.py with
    dflash.py; needs `target`)."""

    def __init__(
        self,
        config: SpeculativeConfig,
        *,
        vocab_size: int = 0,
        max_num_reqs: int = 256,
        max_model_len: int = 2048,
        device: torch.device | str = "cpu",
        target: CausalLM | None = None,
    ) -> None:
        self.config = config
        self.vocab_size = vocab_size
        self.book = ProposalBook(max_num_reqs)
        self.proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        self.draft_model: DraftModelDrafter | None = None
        # a drafter fed the target's features: a chain head, or a DFlash block draft
        self.features: FeatureDrafter | BlockDrafter | None = None
        method = config.method
        if method == "draft":
            if not config.model:
                raise ValueError("MESHLLM_SPEC_METHOD=draft needs MESHLLM_SPEC_MODEL")
            from services.worker.loader import load_model
            from services.worker.models.layer_impls import REFERENCE
            from services.worker.parallel.group import SINGLE

            # The reference layers on every device: the draft's attention is the reference
            # path too, over its private cache (row_kv.py). Whole on every rank of a
            # tensor-parallel group (a group of one: no shard plan, no collectives).
            model, _ = load_model(
                config.model, "auto", device, max_model_len, impls=REFERENCE, tp=SINGLE
            )
            self.draft_model = DraftModelDrafter(
                model,
                vocab_size,
                config.num_spec_tokens,
                max_num_reqs,
                max_model_len,
                d2t=load_d2t(config.model),
                device=device,
            )
        elif method in ("eagle", "eagle3", "mtp"):
            if target is None:
                raise ValueError(f"a {method} drafter needs the target model")
            head, d2t = load_head(config, target, torch.device(device), max_model_len)
            self.features = FeatureDrafter(
                head, target, vocab_size, max_num_reqs, max_model_len, d2t=d2t, device=device
            )
        elif method == "dflash":
            if target is None:
                raise ValueError("a dflash drafter needs the target model")
            if not config.model:
                raise ValueError("MESHLLM_SPEC_METHOD=dflash needs MESHLLM_SPEC_MODEL (the draft)")
            dtype = next(target.parameters()).dtype
            block = load_dflash_head(
                config.model, target.config.num_hidden_layers, dtype, device, max_model_len
            )
            target.aux_hidden_layers = block.aux_layers  # type: ignore[assignment]
            self.features = BlockDrafter(
                block, target, vocab_size, config.num_spec_tokens, max_num_reqs, max_model_len,
                device=device,
            )  # fmt: skip
        elif method != "ngram":
            raise ValueError(f"unknown MESHLLM_SPEC_METHOD={method!r} ({', '.join(METHODS)})")

    def release(self, row: int) -> None:
        """The row's request left the batch (finished, preempted, reset)."""
        self.book.drop(row)
        if self.features is not None:
            self.features.release(row)
        if self.draft_model is not None:
            self.draft_model.release(row)

    def propose_missing(
        self, batch: InputBatch, lookahead: Mapping[str, int], sampler: SamplingState
    ) -> None:
        """Prompt lookup: propose now for the requests given lookahead slots whose row holds no
        proposal for its current tokens (their last steps ran chained on the device,
        spec/chain.py, which keeps no host proposals)."""
        if self.draft_model is not None or self.features is not None:
            return
        missing = [
            row
            for request_id in lookahead
            if (row := batch.req_rows.get(request_id)) is not None
            and self.book.current(row, request_id, int(batch.num_tokens[row])) is None
        ]
        if missing:
            self.propose(batch, np.array(missing, dtype=np.int64), sampler)

    def observe(
        self,
        batch: InputBatch,
        hidden: torch.Tensor,
        aux: torch.Tensor | None,
        rows: np.ndarray,
        query_lens: np.ndarray,
        seq_lens: np.ndarray,
    ) -> None:
        """After each forward (sampled or not): a feature head takes the step's target
        features; other drafters need nothing."""
        if self.features is not None:
            self.features.observe(batch, hidden, aux, rows, query_lens, seq_lens)

    def propose(
        self, batch: InputBatch, rows: np.ndarray, sampler: SamplingState
    ) -> list[list[int]]:
        """Drafts per row (possibly empty), from the row's verified tokens; each row's proposal
        is kept for its verification. K is capped so the drafts and the bonus token stay
        within max_model_len."""
        ks = np.zeros(len(rows), dtype=np.int64)
        for i, row in enumerate(rows.tolist()):
            num_tokens = int(batch.num_tokens[row])
            room = batch.max_model_len - 1 - num_tokens
            if room > 0 and batch.sampling[row] is not None:
                ks[i] = min(self.config.num_spec_tokens, room)
        proposals: list[Proposal | None] = [None] * len(rows)
        if self.draft_model is None and self.features is None:  # prompt lookup: point masses
            lengths = batch.num_tokens[rows]
            found = self.proposer.propose(batch.token_ids, rows, lengths, ks)
            for i, row in enumerate(rows.tolist()):
                if ks[i]:
                    proposals[i] = Proposal(batch.row_req[row] or "", int(lengths[i]), found[i])
        else:
            features = self.features
            active = np.flatnonzero(
                (ks > 0)
                & np.array(
                    [features is None or features.ready(batch, r) for r in rows.tolist()],
                    dtype=bool,
                )
            )
            if active.size:
                vocab_map = (features or self.draft_model).vocab_map  # type: ignore[union-attr]
                draws = DraftSampler(
                    sampler, batch, rows[active], ks[active], self.vocab_size, vocab_map
                )
                if features is not None:
                    features.propose(batch, draws)
                else:
                    assert self.draft_model is not None
                    self.draft_model.propose(batch, draws)
                made = draws.proposals(draws.drafts())
                for i, proposal in zip(active.tolist(), made, strict=True):
                    proposals[i] = proposal
        for row, kept in zip(rows.tolist(), proposals, strict=True):
            self.book.put(row, kept)
        return [p.drafts if p is not None else [] for p in proposals]


def load_head(
    config: SpeculativeConfig, target: CausalLM, device: torch.device, max_model_len: int
) -> tuple[FeatureHead, torch.Tensor | None]:
    """(the feature head of `config.method`, its d2t or None). EAGLE-3 also makes the target
    return the auxiliary layer states its head reads (CausalLM.forward)."""
    dtype = next(target.parameters()).dtype
    if config.method == "mtp":  # the modules live in the target's own checkpoint
        if not config.model:
            raise ValueError("MESHLLM_SPEC_METHOD=mtp needs the target checkpoint's directory")
        return load_mtp_head(config.model, target, dtype, device, max_model_len), None
    if not config.model:
        raise ValueError(f"MESHLLM_SPEC_METHOD={config.method} needs MESHLLM_SPEC_MODEL (the head)")
    if config.method == "eagle3":
        layers = target.config.num_hidden_layers
        head3, d2t = load_eagle3_head(config.model, layers, dtype, device, max_model_len)
        target.aux_hidden_layers = head3.aux_layers  # type: ignore[assignment]
        return head3, d2t
    return load_eagle_head(config.model, dtype, device, max_model_len)
