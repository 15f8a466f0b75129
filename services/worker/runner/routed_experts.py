"""Routed experts: the top-k expert ids every MoE layer picked for every computed position.

Two parts, split by lifetime:

- `RoutedExpertsRecorder` lives on the model. While a forward runs with it started, each sparse
  MoE block hands it its top-k ids ([T, top_k] int32, flat-batch rows); `finish` stacks them
  into [T, moe_layers, top_k]. Not started, recording is one attribute check per layer.
- `RoutedExpertsTracker` lives in the runner. It keeps, per request that asked for routed experts,
  the rows of the positions computed since its last sampled token, and hands them out with the
  next sampled token. Why buffer: the scheduler reads a SampledTokens only when a token was
  sampled (a partial prefill chunk returns nothing), so rows of earlier prompt chunks travel
  with the request's first sampled token.

What a SampledTokens carries (the worker's contract with the scheduler): `routed_experts_shape`
[n, moe_layers, top_k] and the rows of the n positions computed for the request since the
previous SampledTokens (or since it entered the batch), in position order. For a fresh request
the first one therefore holds positions num_computed_tokens .. prompt_len - 1 (all prompt
positions when there was no prefix hit; the last of them produced the first token), and each
later one holds the single position whose forward produced its token (position
prompt_len + i - 1 for output token i). A request resumed after preemption recomputes from
its NewRequestData.num_computed_tokens, so its first rows start there again.
"""

from __future__ import annotations

import numpy as np
import torch

from shared.protocol import StepPlan


class RoutedExpertsRecorder:
    def __init__(self, num_moe_layers: int, top_k: int) -> None:
        self.num_moe_layers = num_moe_layers
        self.top_k = top_k
        self.active = False
        self._ids: list[torch.Tensor | None] = []

    def start(self) -> None:
        self.active = True
        self._ids = [None] * self.num_moe_layers

    def record(self, moe_layer: int, topk_ids: torch.Tensor) -> None:
        if self.active:
            self._ids[moe_layer] = topk_ids

    def finish(self) -> torch.Tensor:
        """[T, moe_layers, top_k] int32 of the forward since `start` (on the model's device)."""
        self.active = False
        ids, self._ids = self._ids, []
        missing = [i for i, t in enumerate(ids) if t is None]
        if missing:
            raise RuntimeError(f"MoE layers {missing} recorded no routed experts")
        return torch.stack([t.to(torch.int32) for t in ids if t is not None], dim=1)


class RoutedExpertsTracker:
    """The runner's side: which requests asked, and their rows awaiting a sampled token."""

    def __init__(self, recorder: RoutedExpertsRecorder | None) -> None:
        self.recorder = recorder  # None: the model has no MoE layer
        self.wanted: set[str] = set()
        self._pending: dict[str, list[np.ndarray]] = {}

    def apply(self, plan: StepPlan) -> None:
        """Follow the plan's diff: requests leaving the batch drop their rows; new ones (also
        a resumed request, which recomputes from its num_computed_tokens) start afresh."""
        for request_id in (*plan.finished_request_ids, *plan.preempted_request_ids):
            self.wanted.discard(request_id)
            self._pending.pop(request_id, None)
        for new in plan.new_requests:
            self._pending.pop(new.request_id, None)
            if new.return_routed_experts and self.recorder is not None:
                self.wanted.add(new.request_id)
            else:
                self.wanted.discard(new.request_id)

    def begin(self, request_ids: list[str]) -> bool:
        """Start recording if a request of this forward asked; True when recording."""
        if self.recorder is None or not self.wanted.intersection(request_ids):
            return False
        self.recorder.start()
        return True

    def collect(self, request_ids: list[str], query_lens: np.ndarray) -> None:
        """After the forward: file each asking request's rows (flat-batch order)."""
        assert self.recorder is not None
        ids = self.recorder.finish().cpu().numpy()
        ends = np.cumsum(query_lens)
        for i, request_id in enumerate(request_ids):
            if request_id in self.wanted:
                rows = ids[int(ends[i] - query_lens[i]) : int(ends[i])]
                self._pending.setdefault(request_id, []).append(rows)

    def attach(self, fields: dict[str, object], request_id: str) -> None:
        """Move the request's pending rows into a SampledTokens' fields."""
        parts = self._pending.pop(request_id, None)
        if not parts:
            return
        rows = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)
        fields["routed_experts"] = rows.reshape(-1).tolist()
        fields["routed_experts_shape"] = list(rows.shape)

    def clear(self) -> None:
        self.wanted.clear()
        self._pending.clear()
