"""Per-row sampling state of the worker's persistent batch, and the sampling step.

PLACEHOLDER: greedy and plain temperature sampling only. The sampling issue replaces the body
with the Murmur3 Gumbel-max sampler and the full parameter set, keeping this API:

- rows are slots of the persistent batch (0 .. max_num_reqs-1); a request keeps its row while
  it lives in the batch;
- `add_request` / `remove_request` when the batch composition changes (not every step);
- `record_sampled` after each step, vectorized (penalties and min_tokens need output counts);
- `sample(logits, rows, positions, bitmask)`: `positions[i]` is the sequence position of the
  token being sampled for row `rows[i]` (the counter of the RNG).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.protocol import SamplingParams


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None = None  # [B] float32, logprob of the sampled token
    top_token_ids: torch.Tensor | None = None  # [B, k] int64
    top_logprobs: torch.Tensor | None = None  # [B, k] float32


class SamplingState:
    def __init__(
        self,
        max_num_reqs: int,
        vocab_size: int,
        device: torch.device | str = "cpu",
        eos_token_ids: list[int] | None = None,
    ) -> None:
        self.max_num_reqs = max_num_reqs
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.eos_token_ids = list(eos_token_ids or [])
        self.temperature = torch.zeros(max_num_reqs, dtype=torch.float32, device=self.device)
        self.seed = torch.zeros(max_num_reqs, dtype=torch.int64, device=self.device)
        self.params: list[SamplingParams | None] = [None] * max_num_reqs

    def add_request(
        self,
        row: int,
        params: SamplingParams,
        prompt_token_ids: list[int],
        output_token_ids: list[int],
    ) -> None:
        self.params[row] = params
        self.temperature[row] = params.temperature
        self.seed[row] = params.seed & 0x7FFFFFFFFFFFFFFF

    def remove_request(self, row: int) -> None:
        self.params[row] = None

    def record_sampled(self, rows: torch.Tensor, token_ids: torch.Tensor) -> None:
        """Rows `rows` just produced `token_ids` (1-D, same length)."""

    def sample(
        self,
        logits: torch.Tensor,
        rows: torch.Tensor,
        positions: torch.Tensor,
        bitmask: torch.Tensor | None = None,
    ) -> SamplerOutput:
        logits = logits.float()
        temps = self.temperature[rows]
        greedy = logits.argmax(dim=-1)
        if bool((temps == 0).all()):
            return SamplerOutput(token_ids=greedy)
        probs = torch.softmax(logits / temps.clamp_min(1e-6).unsqueeze(1), dim=-1)
        sampled = torch.multinomial(probs, 1).squeeze(1)
        return SamplerOutput(token_ids=torch.where(temps == 0, greedy, sampled))
