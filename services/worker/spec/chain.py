"""Verify steps chained on the device: n-gram drafts, inputs and acceptance without the host.

A verify step planned ahead (StepPlan.spec_lookahead) still needed the previous step's tokens
on the host: the drafts are proposed from them, and the step's positions and KV slots depend
on how many drafts were accepted. So the GPU waited ~1 ms a verify step for a copy back, the
acceptance, the n-gram lookup and the next step's staging (bench/RESULTS.md). Here each row's
tokens also live on the device (`tokens`, `length`), and a step does everything from them:

1. propose: the n-gram drafts of each row (device_ngram.py), cut to the plan's slots, to
   max_tokens and to max_model_len;
2. lay out: request i's 1 + slots tokens (its last token, its drafts, pads) at padded rows
   [i W, (i + 1) W), W = K + 1, as the verify graphs take them (accel/verify_graphs.py): the
   real rows at positions T - 1 .. T - 1 + d, pads on the last real position with KV slot -1,
   the sequence counted with the pads;
3. after the forward and one draw per row (positions T + j, the noise plain decoding would
   use there): accept the drafts up to the first draw that differs (the same-noise rule of
   verify.py; n-gram drafts are point masses), write the draws at T .. T + K and advance
   `length` by the accepted drafts + 1.

The host learns the outcome when the step's packed result ([count, drafts, draws...] per row)
lands, appends the tokens to its batch and answers the scheduler; by then the next step may be
queued behind this one. The host keeps `known` (tokens the device holds for the row, as of the
last landing) and `ahead` (the most tokens the steps in flight may add), so it can upload what
other steps appended (a prefill's token, a host-verified step) and bound a row's length without
asking the device.

On CUDA each half is one Triton kernel (meshllm_kernels/spec/chain_kernels.py: the PyTorch
below is some eighty launches, ~1.3 ms of host time a step, more than the forward); the
PyTorch here is the CPU path and the kernels' reference.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from services.worker.runner.input_batch import InputBatch
from services.worker.spec.device_ngram import ngram_drafts


@dataclass
class ChainedInputs:
    """One chained step's inputs on the device, padded to W = K + 1 rows per request."""

    lengths: torch.Tensor  # [R] tokens of each row before the step (T)
    drafts: torch.Tensor  # [R, K]
    num_drafts: torch.Tensor  # [R]
    active: torch.Tensor  # [R] bool: below max_tokens (else nothing is computed or sampled)
    input_ids: torch.Tensor  # [R * W]
    positions: torch.Tensor  # [R * W]
    slots: torch.Tensor  # [R * W] KV slot, -1 for pads
    seq_lens: torch.Tensor  # [R] keys of each request's span, pads counted
    real: torch.Tensor | None = None  # [R, W] bool: a real (not pad) row (PyTorch path)

    def kernel_outputs(self) -> dict[str, torch.Tensor]:
        return {
            "input_ids": self.input_ids,
            "positions": self.positions,
            "slots": self.slots,
            "seq_lens": self.seq_lens,
            "drafts": self.drafts,
            "num_drafts": self.num_drafts,
            "lengths": self.lengths,
            "active": self.active,
        }


class DraftChain:
    """The device's copy of each row's tokens and the steps that run from it."""

    def __init__(
        self,
        max_num_reqs: int,
        max_model_len: int,
        capacity: int,
        num_spec_tokens: int,
        min_n: int,
        max_n: int,
        device: torch.device,
    ) -> None:
        """`capacity`: keys a request's block table reaches (max_blocks_per_req x block_size)."""
        self.k = num_spec_tokens
        self.width = num_spec_tokens + 1
        self.max_model_len = max_model_len
        self.capacity = capacity
        self.min_n, self.max_n = min_n, max_n
        self.device = device
        # Draws are written at T .. T + K; T - 1 + W <= capacity (fits), so this never overflows.
        # One row more than the batch's: the pad requests of a chained graph use it.
        self.scratch_row = max_num_reqs
        self.tokens = torch.zeros(
            max_num_reqs + 1, capacity + self.width + 1, dtype=torch.int32, device=device
        )
        self.length = torch.zeros(max_num_reqs + 1, dtype=torch.int64, device=device)
        self.known = np.zeros(max_num_reqs, dtype=np.int64)
        self.ahead = np.zeros(max_num_reqs, dtype=np.int64)
        self._offsets = torch.arange(self.width, device=device)

    def forget(self, row: int) -> None:
        """The row left the batch or holds a new request: its device tokens count for nothing."""
        self.known[row] = 0
        self.ahead[row] = 0

    def reset(self) -> None:
        self.known[:] = 0
        self.ahead[:] = 0

    def fits(self, batch: InputBatch, rows: np.ndarray) -> bool:
        """Whether every row's padded span stays within its block table and max_model_len at
        the most tokens it may hold once the steps in flight land."""
        upper = batch.num_tokens[rows] + self.ahead[rows]
        return bool((upper - 1 + self.width <= self.capacity).all()) and bool(
            (upper <= self.max_model_len).all()
        )

    def window(self, batch: InputBatch, rows: np.ndarray) -> int:
        """Columns of `tokens` a step's lookup reads: the longest row it may hold, rounded up
        to 256 (few distinct shapes)."""
        upper = int((batch.num_tokens[rows] + self.ahead[rows]).max())
        return min(-(-upper // 256) * 256, self.tokens.shape[1])

    def sync(
        self, batch: InputBatch, rows: np.ndarray, to_device: Callable[[np.ndarray], torch.Tensor]
    ) -> None:
        """Upload the tokens the host appended to these rows outside the chain (a new request,
        a prefill's token, a step verified on the host), in one copy. Rows with chained steps
        in flight are current (known == the host's count until they land)."""
        ends = batch.num_tokens[rows]
        stale = np.flatnonzero(self.known[rows] != ends)
        if not stale.size:
            return
        rows, ends = rows[stale], ends[stale]
        starts = np.minimum(self.known[rows], ends)
        counts = ends - starts
        flat_rows = np.repeat(rows, counts)
        cu = np.cumsum(counts)
        positions = np.arange(int(cu[-1])) + np.repeat(starts - (cu - counts), counts)
        values = batch.token_ids[flat_rows, positions]
        n, m = len(flat_rows), len(rows)
        packed = to_device(np.concatenate([flat_rows, positions, values, rows, ends]))
        self.tokens[packed[:n], packed[n : 2 * n]] = packed[2 * n : 3 * n].to(torch.int32)
        self.length[packed[3 * n : 3 * n + m]] = packed[3 * n + m :]
        self.known[rows] = ends

    def lay_out(
        self,
        rows: torch.Tensor,
        slots: torch.Tensor,
        limits: torch.Tensor,
        block_tables: torch.Tensor,
        block_size: int,
        window: int,
        into: dict[str, torch.Tensor] | None = None,
    ) -> ChainedInputs:
        """Propose and lay out one step (see the module doc). rows, slots, limits (prompt +
        max_tokens: the most tokens the request may hold) [R]; block_tables [R, >= the blocks
        the spans reach]. On CUDA, `into` (input_ids, positions, slots, seq_lens: a verify
        graph's inputs) receives the layout, and the kernel searches each row whole (`window`,
        the PyTorch path's columns, is unused). No host synchronization."""
        if self.device.type == "cuda":
            from meshllm_kernels.spec.chain_kernels import lay_out_  # CUDA builds only

            r = len(rows)
            tokens = r * self.width
            new = rows.new_empty
            into = into or {
                "input_ids": new(tokens),
                "positions": new(tokens),
                "slots": new(tokens),
                "seq_lens": new(r),
            }
            step = ChainedInputs(
                lengths=new(r),
                drafts=new(r, self.k),
                num_drafts=new(r),
                active=new(r),
                input_ids=into["input_ids"][:tokens],
                positions=into["positions"][:tokens],
                slots=into["slots"][:tokens],
                seq_lens=into["seq_lens"][:r],
            )
            lay_out_(
                self.tokens, self.length, rows, slots, limits, block_tables, step.kernel_outputs(),
                k=self.k, min_n=self.min_n, max_n=self.max_n, max_model_len=self.max_model_len,
                block_size=block_size,
            )  # fmt: skip
            return step
        lengths = self.length[rows]
        last = (lengths - 1).clamp(min=0)
        active = limits > lengths
        room = torch.minimum(slots, limits - lengths - 1)
        room = torch.minimum(room, self.max_model_len - 1 - lengths)
        history = self.tokens[rows, :window]
        drafts, num_drafts = ngram_drafts(history, lengths, room, self.k, self.min_n, self.max_n)
        num_drafts = torch.where(active, num_drafts, torch.zeros_like(num_drafts))
        j = self._offsets[None, :]
        ids = torch.cat([history.gather(1, last[:, None]).to(torch.int64), drafts], dim=1)
        real = (j <= num_drafts[:, None]) & active[:, None]
        positions = last[:, None] + torch.minimum(j, num_drafts[:, None])
        blocks = block_tables.gather(
            1, (positions // block_size).clamp(max=block_tables.shape[1] - 1)
        ).to(torch.int64)
        kv_slots = torch.where(real, blocks * block_size + positions % block_size, -1)
        return ChainedInputs(
            lengths=lengths,
            drafts=drafts,
            num_drafts=num_drafts,
            active=active,
            input_ids=torch.where(real, ids, 0).flatten(),
            positions=positions.flatten(),
            slots=kv_slots.flatten(),
            seq_lens=last + self.width,
            real=real,
        )

    def accept(
        self, rows: torch.Tensor, inputs: ChainedInputs, draws: torch.Tensor, latest: torch.Tensor
    ) -> torch.Tensor:
        """Accept each row's drafts against its draws [R, W] (position T + j's draw in column
        j), write the draws after the row's tokens and advance its length; `latest` (the
        runner's newest token per row) gets the last emitted token. Returns [R, 2 + W] int64:
        tokens emitted (0: inactive), drafts verified, the draws."""
        if self.device.type == "cuda":
            from meshllm_kernels.spec.chain_kernels import accept_  # CUDA builds only

            packed = rows.new_empty(len(rows), self.width + 2)
            outputs = inputs.kernel_outputs()
            accept_(self.tokens, self.length, latest, rows, draws, outputs, packed, k=self.k)
            return packed
        k = self.k
        verified = self._offsets[None, :k] < inputs.num_drafts[:, None]
        matches = (draws[:, :k] == inputs.drafts) & verified
        accepted = torch.cumprod(matches.to(torch.int64), dim=1).sum(dim=1)
        counts = torch.where(inputs.active, accepted + 1, 0)
        at = inputs.lengths[:, None] + self._offsets[None, :]
        self.tokens[rows[:, None], at] = draws.to(torch.int32)
        self.length[rows] = inputs.lengths + counts
        newest = draws.gather(1, accepted[:, None]).squeeze(1)
        latest[rows] = torch.where(inputs.active, newest, latest[rows])
        return torch.cat([counts[:, None], inputs.num_drafts[:, None], draws], dim=1)

    def land(
        self,
        batch: InputBatch,
        rows: np.ndarray,
        slots: np.ndarray,
        live: np.ndarray,
        packed: np.ndarray,
    ) -> list[tuple[int, list[int], int]]:
        """A chained step's result reached the host: append each live row's tokens to the batch
        (KV stands for all but the last). Returns (index, tokens, drafts verified) of the rows
        that emitted tokens."""
        emitted = []
        for i in np.flatnonzero(live).tolist():
            row = int(rows[i])
            self.ahead[row] -= 1 + int(slots[i])
            count = int(packed[i, 0])
            if not count:
                continue
            tokens = packed[i, 2 : 2 + count]
            start = int(batch.num_tokens[row])
            room = min(count, batch.max_model_len - start)
            batch.token_ids[row, start : start + room] = tokens[:room]
            batch.num_tokens[row] = start + room
            batch.num_computed_tokens[row] = start + count - 1
            self.known[row] = start + count
            emitted.append((i, tokens.tolist(), int(packed[i, 1])))
        return emitted
