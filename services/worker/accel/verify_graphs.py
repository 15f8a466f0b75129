"""CUDA graphs for verification steps: every request k + 1 query tokens, replayed every step.

With speculative decoding on, a step that verifies drafts gives each request 1 + d tokens (its
last sampled token and d <= k drafts); eager, that step is a few hundred kernel launches from
Python, more than the GPU time of a small model, and spends the speed-up the drafts bought.
Here the forward of a step of R requests x (k + 1) tokens is captured once per size R and
replayed, as vLLM captures its uniform spec-decode batches.

Real steps are rarely uniform (an n-gram drafter proposes 0..k drafts), so each request is
padded to k + 1 tokens at the end of its span, and the batch to the captured size R:

- request i's tokens sit at rows [i (k+1), i (k+1) + q_i), its pad rows after them: token 0 at
  the request's last real position (a valid RoPE row), KV slot -1 (kv_insert skips the write);
  its sequence length is counted with the pads (seq_len + k + 1 - q_i), so the attention kernel,
  which places a span's queries at the end of its sequence, puts the real rows at their own
  positions; causal attention keeps them from the pads after them (a pad reads keys past the
  request's last token: never written this step, of its own or the null block, and ignored);
- a pad request: tokens 0, slots -1, k + 1 keys over block 0 (the scheduler's null block);
- `gather` picks the real rows out of the padded output, in the step's flat order.

Every row is independent in every kernel but the attention, so pads cannot change real rows.
Attention runs on the paged prefill kernel with one span per request (`max_seqlen_q` = k + 1, no
host read); the decode chain's GEMVs take steps of up to 16 tokens as for decodes. A step with a
prefill chunk, a token still on the device, or a padded length past the block table runs eagerly
(`layout` returns None). A chained verify step (services/worker/spec/chain.py) computes its
padded rows on the device from the previous step's tokens: `stage_tables` + `run_chained`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from meshllm_kernels.attention.backends import PagedKernelBackend
from services.worker.accel.cuda_graphs import capture_graphs, graph_sizes, padded_size
from services.worker.accel.span_graphs import SpanGraphs
from services.worker.attention.select import TritonAttentionMetadata
from services.worker.models.base import CausalLM

#: Request counts captured: a verify step of R requests runs R x (k + 1) tokens.
VERIFY_SIZES: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)


@dataclass(frozen=True)
class VerifyLayout:
    """One step's inputs padded to `size` requests x `width` tokens (see the module doc)."""

    size: int
    input_ids: np.ndarray  # [size * width]
    positions: np.ndarray  # [size * width]
    slots: np.ndarray  # [size * width]
    seq_lens: np.ndarray  # [size]
    gather: np.ndarray  # [T]: the padded row of each real token, in the step's flat order


def verify_layout(
    query_lens: np.ndarray,
    seq_lens: np.ndarray,
    input_ids: np.ndarray,
    positions: np.ndarray,
    slot_mapping: np.ndarray,
    *,
    width: int,
    size: int,
    capacity: int,
) -> VerifyLayout | None:
    """The padded layout of a step of len(query_lens) requests in a graph of `size` requests of
    `width` tokens, or None where it does not fit: a request of more than `width` tokens, more
    requests than `size`, or a padded sequence past `capacity` keys (the block table's)."""
    q = np.asarray(query_lens, dtype=np.int64)
    n = len(q)
    if n == 0 or n > size or q.min() < 1 or q.max() > width:
        return None
    padded_lens = np.asarray(seq_lens, dtype=np.int64) + (width - q)
    if padded_lens.max() > capacity:
        return None
    starts = np.cumsum(q) - q  # each request's first flat token
    # Flat token t of request i, j-th of its span -> padded row i * width + j.
    owner = np.repeat(np.arange(n), q)
    gather = owner * width + (np.arange(int(q.sum())) - starts[owner])
    rows = size * width
    ids = np.zeros(rows, dtype=np.int64)
    pos = np.zeros(rows, dtype=np.int64)
    slots = np.full(rows, -1, dtype=np.int64)
    last = np.asarray(positions, dtype=np.int64)[starts + q - 1]
    pos[: n * width] = np.repeat(last, width)  # pad rows: the request's last real position
    ids[gather] = input_ids
    pos[gather] = positions
    slots[gather] = slot_mapping
    lens = np.full(size, width, dtype=np.int64)  # pad requests: `width` keys of block 0
    lens[:n] = padded_lens
    return VerifyLayout(size, ids, pos, slots, lens, gather)


class VerifyGraphs(SpanGraphs):
    """Captured verification forwards (R requests x (k + 1) tokens) of one model and KV cache."""

    def __init__(
        self,
        model: CausalLM,
        kv_layers: list[torch.Tensor],
        backend: PagedKernelBackend,
        *,
        num_spec_tokens: int,
        max_num_reqs: int,
        max_blocks_per_req: int,
        block_size: int,
        device: torch.device | str,
        sizes: tuple[int, ...] = VERIFY_SIZES,
        upload_stream: torch.cuda.Stream | None = None,
        request_fields: tuple[str, ...] = (),
    ) -> None:
        """`request_fields`: more int64 inputs of one value per request (chain_graphs.py)."""
        if num_spec_tokens < 1:
            raise ValueError(f"verify graphs need num_spec_tokens >= 1, got {num_spec_tokens}")
        self.width = num_spec_tokens + 1
        self.capacity = max_blocks_per_req * block_size
        self.block_size = block_size
        # Up to the largest listed size: past it a step is long enough to pay its launches.
        chosen = graph_sizes(min(max_num_reqs, sizes[-1]), sizes)
        rows = chosen[-1]
        tokens = rows * self.width
        fields = {
            "input_ids": ((tokens,), torch.int64),
            "positions": ((tokens,), torch.int64),
            "slots": ((tokens,), torch.int64),
            "seq_lens": ((rows,), torch.int32),
            **{name: ((rows,), torch.int64) for name in request_fields},
            "block_tables": ((rows, max_blocks_per_req), torch.int32),  # last: see stage
        }
        super().__init__(
            model, kv_layers, backend, sizes=chosen, fields=fields, tokens=tokens, device=device,
            upload_stream=upload_stream,
        )  # fmt: skip
        self.cu_seqlens_q = torch.arange(
            0, tokens + 1, self.width, dtype=torch.int32, device=self.device
        )

    def metadata(self, size: int) -> TritonAttentionMetadata:
        """Metadata over the static buffers' first `size` requests: one prefill span each."""
        tokens = size * self.width
        return TritonAttentionMetadata(
            num_tokens=tokens,
            slot_mapping=self.static["slots"][:tokens],
            token_index=self.token_index[:tokens],
            num_kv_heads=self.num_kv_heads,
            backend=self.backend,
            prefill_block_tables=self.static["block_tables"][:size],
            prefill_cu_seqlens_q=self.cu_seqlens_q[: size + 1],
            prefill_seq_lens=self.static["seq_lens"][:size],
            prefill_max_seqlen_q=self.width,
        )

    def forward(self, size: int, meta: TritonAttentionMetadata) -> torch.Tensor:
        tokens = size * self.width
        ids = self.static["input_ids"][:tokens]
        positions = self.static["positions"][:tokens]
        hidden: torch.Tensor = self.model(ids, positions, meta, self.kv_layers)
        return hidden

    @torch.inference_mode()
    def capture(self) -> float:
        """Capture every size (largest first, one memory pool); returns seconds."""
        self.stage(self._pad_only(self.sizes[-1]), np.zeros((0, 1), dtype=np.int32))
        return capture_graphs(self, "verify")

    def _pad_only(self, size: int) -> VerifyLayout:
        w = self.width
        empty = np.zeros(0, dtype=np.int64)
        return VerifyLayout(
            size,
            np.zeros(size * w, dtype=np.int64),
            np.zeros(size * w, dtype=np.int64),
            np.full(size * w, -1, dtype=np.int64),
            np.full(size, w, dtype=np.int64),
            empty,
        )

    def layout(
        self,
        query_lens: np.ndarray,
        seq_lens: np.ndarray,
        input_ids: np.ndarray,
        positions: np.ndarray,
        slot_mapping: np.ndarray,
    ) -> VerifyLayout | None:
        """The step padded for a captured graph, or None (it runs eagerly)."""
        size = padded_size(len(query_lens), self.sizes)  # ascending: the smallest that holds
        if size is None or size not in self.graphs:
            return None
        return verify_layout(
            query_lens, seq_lens, input_ids, positions, slot_mapping,
            width=self.width, size=size, capacity=self.capacity,
        )  # fmt: skip

    def run(self, layout: VerifyLayout, block_tables: np.ndarray) -> torch.Tensor:
        """Replay the graph of `layout.size`; returns hidden [T, H] of the real tokens, in the
        step's flat order (gathered from the graph's static output)."""
        self.stage(layout, block_tables)
        out = self._replay(layout.size)
        gather = torch.from_numpy(layout.gather).to(self.device, non_blocking=True)
        return out[gather]

    def stage_tables(self, size: int, block_tables: np.ndarray) -> dict[str, torch.Tensor]:
        """A chained step's first half (services/worker/spec/chain.py): upload the requests'
        block tables with every other field at its pad value; returns the static inputs on
        the device (the step's rows are computed there, from the tables, into the others)."""
        rows = size * self.width
        pads = {
            "input_ids": np.zeros(rows, dtype=np.int64),
            "positions": np.zeros(rows, dtype=np.int64),
            "slots": np.full(rows, -1, dtype=np.int64),
            "seq_lens": np.full(size, self.width, dtype=np.int64),
        }
        self._stage(rows, pads, block_tables, size)
        return self.static

    def run_chained(self, size: int, tokens: int) -> torch.Tensor:
        """Its second half: replay; hidden [tokens, H] of the first padded rows."""
        return self._replay(size)[:tokens]

    def stage(self, layout: VerifyLayout, block_tables: np.ndarray) -> None:
        """Write the padded step into the host buffers and upload it in one copy."""
        step = {
            "input_ids": layout.input_ids,
            "positions": layout.positions,
            "slots": layout.slots,
            "seq_lens": layout.seq_lens,
        }
        self._stage(layout.size * self.width, step, block_tables, layout.size)
