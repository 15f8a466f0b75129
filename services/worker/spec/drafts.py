"""Drafts in the persistent batch: staging the plan's drafts, proposing the next step's.

Staging writes a request's drafts right after its verified tokens in `InputBatch.token_ids`
(positions T .. T+k-1) without counting them in `num_tokens`: they are inputs of this step's
forward, not tokens of the request. Verification then overwrites position T+a with the
correction/bonus and sets `num_tokens` to T+a+1, so rejected drafts vanish from the batch; their
KV (slots the scheduler reserved as lookahead) is overwritten by later steps before anything
attends to it, and the scheduler never registers those slots in the prefix cache.

Proposing skips requests whose sampling reads per-row history the verification rows would see
stale (repetition/frequency/presence penalties, and min_tokens not yet reached): those decode
one token per step, unchanged.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from services.worker.runner.input_batch import InputBatch, PlanError
from services.worker.spec.config import SpeculativeConfig
from services.worker.spec.draft_model import DraftModelDrafter, load_d2t
from services.worker.spec.eagle_drafter import EagleDrafter
from services.worker.spec.ngram import NgramProposer
from shared.protocol import SamplingParams, StepPlan

if TYPE_CHECKING:
    from services.worker.models.base import CausalLM


def stage_drafts(
    batch: InputBatch, plan: StepPlan, request_ids: list[str], rows: np.ndarray
) -> np.ndarray:
    """Write the plan's drafts for the listed requests into the batch; returns the draft count
    per request (0 for requests without drafts). PlanError if drafts do not fit the row."""
    counts = np.zeros(len(request_ids), dtype=np.int64)
    for i, request_id in enumerate(request_ids):
        drafts = plan.spec_token_ids.get(request_id)
        if not drafts:
            continue
        row = int(rows[i])
        start = int(batch.num_tokens[row])
        end = start + len(drafts)
        if end >= batch.max_model_len:
            raise PlanError(
                f"{request_id}: {len(drafts)} drafts after {start} tokens leave no room for the "
                f"bonus token within max_model_len={batch.max_model_len}"
            )
        batch.token_ids[row, start:end] = drafts
        counts[i] = len(drafts)
    return counts


def may_speculate(params: SamplingParams | None, num_output_tokens: int) -> bool:
    """Whether verification rows of this request sample as plain decoding would."""
    if params is None:
        return False
    if params.repetition_penalty != 1.0 or params.frequency_penalty or params.presence_penalty:
        return False
    return num_output_tokens >= params.min_tokens


class Drafter:
    """Proposes each sampled request's drafts for the next step: prompt lookup ("ngram") or a
    separate draft model ("draft", services/worker/spec/draft_model.py) or an EAGLE head fed
    the target's features ("eagle", eagle.py / eagle_drafter.py; needs `target`)."""

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
        self.proposer = NgramProposer(
            config.num_spec_tokens, config.prompt_lookup_min, config.prompt_lookup_max
        )
        self.draft_model: DraftModelDrafter | None = None
        if config.method == "draft":
            if not config.model:
                raise ValueError("MESHLLM_SPEC_METHOD=draft needs MESHLLM_SPEC_MODEL")
            from services.worker.loader import load_model
            from services.worker.models.layer_impls import REFERENCE

            # The reference layers on every device: the draft's attention is the reference
            # path too, over its private cache (row_kv.py).
            model, _ = load_model(config.model, "auto", device, max_model_len, impls=REFERENCE)
            self.draft_model = DraftModelDrafter(
                model,
                vocab_size,
                config.num_spec_tokens,
                max_num_reqs,
                max_model_len,
                d2t=load_d2t(config.model),
                device=device,
            )
        self.eagle: EagleDrafter | None = None
        if config.method == "eagle":
            if not config.model:
                raise ValueError("MESHLLM_SPEC_METHOD=eagle needs MESHLLM_SPEC_MODEL (the head)")
            if target is None:
                raise ValueError("an EAGLE drafter needs the target model")
            from services.worker.spec.eagle import load_eagle_head

            dtype = next(target.parameters()).dtype
            head, d2t = load_eagle_head(config.model, dtype, device, max_model_len)
            self.eagle = EagleDrafter(
                head, target, vocab_size, max_num_reqs, max_model_len, d2t=d2t, device=device
            )
        elif config.method not in ("ngram", "draft"):
            raise ValueError(f"unknown MESHLLM_SPEC_METHOD={config.method!r} (ngram, draft, eagle)")

    def observe(
        self,
        batch: InputBatch,
        hidden: torch.Tensor,
        rows: np.ndarray,
        query_lens: np.ndarray,
        seq_lens: np.ndarray,
    ) -> None:
        """After each forward (sampled or not): the EAGLE head takes the step's target
        features; other drafters need nothing."""
        if self.eagle is not None:
            self.eagle.observe(batch, hidden, rows, query_lens, seq_lens)

    def propose(self, batch: InputBatch, rows: np.ndarray) -> list[list[int]]:
        """Drafts per row (possibly empty), from the row's verified tokens. K is capped so the
        drafts and the bonus token stay within max_model_len."""
        ks: list[int] = []
        for row in rows.tolist():
            num_tokens = int(batch.num_tokens[row])
            room = batch.max_model_len - 1 - num_tokens
            num_output = num_tokens - int(batch.num_prompt_tokens[row])
            if room <= 0 or not may_speculate(batch.sampling[row], num_output):
                ks.append(0)
            else:
                ks.append(min(self.config.num_spec_tokens, room))
        if self.draft_model is not None:
            return self.draft_model.propose(batch, rows, ks)
        if self.eagle is not None:
            return self.eagle.propose(batch, rows, ks)
        return [
            self.proposer.propose(batch.token_ids[row, : int(batch.num_tokens[row])], k)
            if k
            else []
            for row, k in zip(rows.tolist(), ks, strict=True)
        ]
