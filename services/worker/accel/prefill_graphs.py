"""CUDA graphs for small prefill and mixed steps: the whole forward replayed at a padded size.

A model small enough that its eager forward is launch-bound pays for every step that the
decode and verify graphs do not take: SmolLM2's 30 layers are ~400 launches from Python, and
on the H200 a prefill step of one 141-token prompt took ~15 ms against ~1.2 ms for a decode
step replayed from its graph (bench.spec_ngram, bench/RESULTS.md). Here the forward of a
step of up to S tokens (prompt chunks, decodes beside them) is captured once per size S and
replayed, as vLLM replays mixed batches from full CUDA graphs on its FlashAttention-3 backend.
Off unless the worker is told the largest size (settings.prefill_graph_tokens): for a large
model the eager launches hide behind the GPU's work, and the paged kernel that every span runs
here is slower on fresh prompts than the dense flash attention of eager steps.

Layout: the step's T tokens keep their flat order in rows [0, T); rows [T, S) are one pad
sequence: token 0 at position 0, KV slot -1 (kv_insert skips the write), S - T keys over block
0 (the scheduler's null block, never handed to a request). Attention runs on the paged prefill
kernel with one span per request (a decode is a span of one) over a table of max_num_reqs + 1
sequences; the sequences after the pad are empty spans. `max_seqlen_q` = S sizes the grid for
any split of S tokens: programs past their span's end return at once (max_num_reqs x S / 64 x
heads of them a layer, a few microseconds for a small model, another reason this is for those).
Every row is independent in every kernel but the attention, and the pad sequence attends only to
itself, so pads cannot change real rows. A token the previous step sampled that the host does
not have yet is written into the static ids on the device before the replay (the runner's feed).
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

#: Token counts captured, up to the configured largest (which is captured too).
PREFILL_SIZES: tuple[int, ...] = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


@dataclass(frozen=True)
class PrefillLayout:
    """One step's inputs padded to `size` tokens over `num_seqs` sequences (module doc)."""

    size: int
    num_tokens: int  # T: the real tokens, rows [0, T)
    input_ids: np.ndarray  # [size]
    positions: np.ndarray  # [size]
    slots: np.ndarray  # [size]
    cu_seqlens_q: np.ndarray  # [num_seqs + 1]
    seq_lens: np.ndarray  # [num_seqs]


def prefill_layout(
    query_lens: np.ndarray,
    seq_lens: np.ndarray,
    input_ids: np.ndarray,
    positions: np.ndarray,
    slot_mapping: np.ndarray,
    *,
    size: int,
    num_seqs: int,
    capacity: int,
) -> PrefillLayout | None:
    """The padded layout of a step of len(query_lens) requests in a graph of `size` tokens and
    `num_seqs` sequences, or None where it does not fit: more tokens than `size`, no sequence
    left for the pad, or a sequence (the pad's included) past `capacity` keys. No requests: all
    pad (what the graphs are captured over)."""
    q = np.asarray(query_lens, dtype=np.int64)
    n, tokens = len(q), int(q.sum())
    if tokens > size or n + 1 > num_seqs or (n and q.min() < 1):
        return None
    if int(np.max(seq_lens, initial=0)) > capacity or size - tokens > capacity:
        return None
    ids = np.zeros(size, dtype=np.int64)
    pos = np.zeros(size, dtype=np.int64)
    slots = np.full(size, -1, dtype=np.int64)
    ids[:tokens] = input_ids
    pos[:tokens] = positions
    slots[:tokens] = slot_mapping
    cu = np.full(num_seqs + 1, size, dtype=np.int64)  # the pad ends at `size`, then empties
    cu[0] = 0
    cu[1 : n + 1] = np.cumsum(q)
    lens = np.zeros(num_seqs, dtype=np.int64)
    lens[:n] = seq_lens
    lens[n] = size - tokens  # the pad attends to its own keys, over block 0
    return PrefillLayout(size, tokens, ids, pos, slots, cu, lens)


class PrefillGraphs(SpanGraphs):
    """Captured forwards of steps of up to S tokens (any split into requests) of one model."""

    def __init__(
        self,
        model: CausalLM,
        kv_layers: list[torch.Tensor],
        backend: PagedKernelBackend,
        *,
        max_tokens: int,
        max_num_reqs: int,
        max_blocks_per_req: int,
        block_size: int,
        device: torch.device | str,
        sizes: tuple[int, ...] = PREFILL_SIZES,
        upload_stream: torch.cuda.Stream | None = None,
    ) -> None:
        if max_tokens < 1:
            raise ValueError(f"prefill graphs need max_tokens >= 1, got {max_tokens}")
        self.capacity = max_blocks_per_req * block_size
        self.num_seqs = max_num_reqs + 1  # every request a span, then the pad
        chosen = graph_sizes(min(max_tokens, self.capacity), sizes)
        tokens = chosen[-1]
        fields = {
            "input_ids": ((tokens,), torch.int64),
            "positions": ((tokens,), torch.int64),
            "slots": ((tokens,), torch.int64),
            "cu_seqlens_q": ((self.num_seqs + 1,), torch.int32),
            "seq_lens": ((self.num_seqs,), torch.int32),
            "block_tables": ((self.num_seqs, max_blocks_per_req), torch.int32),  # last
        }
        super().__init__(
            model, kv_layers, backend, sizes=chosen, fields=fields, tokens=tokens, device=device,
            upload_stream=upload_stream,
        )  # fmt: skip

    def metadata(self, size: int) -> TritonAttentionMetadata:
        """Metadata over the static buffers: `size` tokens, one span per sequence."""
        return TritonAttentionMetadata(
            num_tokens=size,
            slot_mapping=self.static["slots"][:size],
            token_index=self.token_index[:size],
            num_kv_heads=self.num_kv_heads,
            backend=self.backend,
            prefill_block_tables=self.static["block_tables"],
            prefill_cu_seqlens_q=self.static["cu_seqlens_q"],
            prefill_seq_lens=self.static["seq_lens"],
            prefill_max_seqlen_q=size,
        )

    def forward(self, size: int, meta: TritonAttentionMetadata) -> torch.Tensor:
        ids = self.static["input_ids"][:size]
        positions = self.static["positions"][:size]
        hidden: torch.Tensor = self.model(ids, positions, meta, self.kv_layers)
        return hidden

    @torch.inference_mode()
    def capture(self) -> float:
        """Capture every size (largest first, one memory pool); returns seconds."""
        none = np.zeros(0, dtype=np.int64)
        pad_only = prefill_layout(  # no requests: all pad
            *[none] * 5, size=self.sizes[-1], num_seqs=self.num_seqs, capacity=self.capacity
        )
        assert pad_only is not None  # sizes stop at the capacity
        self.stage(pad_only, np.zeros((0, 1), dtype=np.int32))
        return capture_graphs(self, "prefill")

    def layout(
        self,
        query_lens: np.ndarray,
        seq_lens: np.ndarray,
        input_ids: np.ndarray,
        positions: np.ndarray,
        slot_mapping: np.ndarray,
    ) -> PrefillLayout | None:
        """The step padded for a captured graph, or None (it runs eagerly)."""
        size = padded_size(int(np.sum(query_lens)), self.sizes)  # the smallest that holds it
        if size is None or size not in self.graphs:
            return None
        return prefill_layout(
            query_lens, seq_lens, input_ids, positions, slot_mapping,
            size=size, num_seqs=self.num_seqs, capacity=self.capacity,
        )  # fmt: skip

    def replay(self, layout: PrefillLayout) -> torch.Tensor:
        """Replay the graph of `layout.size` (staged first); returns hidden [T, H] of the real
        tokens in the step's flat order (a view of the graph's static output)."""
        return self._replay(layout.size)[: layout.num_tokens]

    def stage(self, layout: PrefillLayout, block_tables: np.ndarray) -> None:
        """Write the padded step into the host buffers and upload it in one copy; the table
        row after the step's requests, the pad sequence's, is zeros (its keys in block 0)."""
        step = {
            "input_ids": layout.input_ids,
            "positions": layout.positions,
            "slots": layout.slots,
            "cu_seqlens_q": layout.cu_seqlens_q,
            "seq_lens": layout.seq_lens,
        }
        self._stage(layout.size, step, block_tables, len(block_tables) + 1)
