"""CUDA graphs for decode-only steps: one graph per padded batch size, replayed every step.

A decode step of an 8B model is a few hundred short kernel launches; launched from Python they
would cost more than the GPU time. So the forward of a step in which every
scheduled request computes exactly one token is captured once per size in `GRAPH_SIZES` and
replayed; a step of n requests runs the graph of the smallest captured size >= n, with the
extra rows padded. Steps with prefill chunks or draft tokens run eagerly (`fits` says which).

Static inputs: the graph reads its inputs from fixed device tensors (token ids, positions, KV
slots, sequence lengths, block tables), typed views into one device allocation paired with one
pinned host allocation (meshllm_kernels.runtime.staged_copy.PackedCpuGpuBuffer). A step writes its
values into the host views and uploads them in one asynchronous copy; the buffer's fence keeps the
host from overwriting bytes still in flight. On CUDA the copy runs on its own stream (see
`_stage`), and a token the previous step sampled but the host does not have yet is read on the
device by the graph's first kernel (meshllm_kernels/decode_chain/token_feed.py), so nothing sits
between two steps' graphs in the compute stream but the sampling.

Padding rows are harmless by construction: slot -1 (kv_insert skips the write), sequence length
1 over block 0 (the scheduler's null block, never handed to a request; reading it is safe),
token 0 at position 0. Their hidden states are computed and ignored. Every row is independent
in every kernel (GEMV/GEMM rows, norms, per-sequence attention), so padding cannot change the
real rows' results.

The split-K factor of the decode attention is fixed per graph (from max_model_len): any
factor is correct for any length, it only changes speed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Protocol

import numpy as np
import torch

from meshllm_kernels.attention.backends import PagedKernelBackend
from meshllm_kernels.runtime.staged_copy import PackedCpuGpuBuffer
from services.worker.accel.gc_pause import collected_then_paused
from services.worker.attention.select import TritonAttentionMetadata, decode_splits
from services.worker.models.base import CausalLM

log = logging.getLogger(__name__)

GRAPH_SIZES: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def graph_sizes(max_num_reqs: int, sizes: tuple[int, ...] = GRAPH_SIZES) -> tuple[int, ...]:
    """The sizes to capture for a batch of at most `max_num_reqs` requests: every listed size
    below it, and max_num_reqs itself so that a full batch never falls back to eager."""
    if max_num_reqs < 1:
        raise ValueError(f"max_num_reqs must be >= 1, got {max_num_reqs}")
    chosen = sorted({s for s in sizes if 1 <= s < max_num_reqs} | {max_num_reqs})
    return tuple(chosen)


def padded_size(num_reqs: int, sizes: tuple[int, ...]) -> int | None:
    """Smallest captured size holding `num_reqs` rows, or None (too many, or none)."""
    if num_reqs < 1:
        return None
    for size in sizes:
        if size >= num_reqs:
            return size
    return None


class StepGraphs(Protocol):
    """What `capture_graphs` and `upload` need of a set of graphs (decode, verify)."""

    sizes: tuple[int, ...]
    device: torch.device
    graphs: dict[int, torch.cuda.CUDAGraph]
    outputs: dict[int, torch.Tensor]
    inputs: PackedCpuGpuBuffer
    upload_stream: torch.cuda.Stream | None
    replayed: torch.cuda.Event | None

    def metadata(self, size: int) -> TritonAttentionMetadata: ...

    def forward(self, size: int, meta: TritonAttentionMetadata) -> torch.Tensor: ...


def capture_graphs(step: StepGraphs, label: str) -> float:
    """Capture `step.forward` at every size (largest first, sharing one memory pool), after
    one eager run per size that compiles and tunes its kernels; returns seconds taken."""
    started = time.perf_counter()
    pool = None
    stream = torch.cuda.Stream(step.device)
    stream.wait_stream(torch.cuda.current_stream(step.device))
    with collected_then_paused():  # no dead engine's graphs freed mid-capture (gc_pause.py)
        for size in reversed(step.sizes):
            meta = step.metadata(size)
            with torch.cuda.stream(stream):
                step.forward(size, meta)  # compiles/tunes kernels outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                step.outputs[size] = step.forward(size, meta)
            pool = graph.pool()
            step.graphs[size] = graph
    torch.cuda.current_stream(step.device).wait_stream(stream)
    torch.cuda.synchronize(step.device)
    seconds = time.perf_counter() - started
    log.info("captured %s CUDA graphs for batch sizes %s in %.1f s", label, step.sizes, seconds)
    return seconds


def no_phase(name: str) -> None:
    """The default `on_phase` of a graph set: no step timeline."""


def upload(step: StepGraphs, upto: int) -> None:
    """Upload the staged inputs' first `upto` bytes. On CUDA, while the previous replay may
    still be reading the buffers (`replayed` not done: a step launched before the previous one
    finished), the copy runs on the upload stream once that replay is done, so it overlaps
    that step's LM head and sampling instead of waiting behind them; the compute stream waits
    for it before the replay. Once that replay is done (steps one at a time, as with a
    drafter) the copy goes straight on the compute stream: the stream switch and the two
    waits cost the host ~50 us a step (72 against 21 us on the H100 machine, 2026-12-05)."""
    if step.upload_stream is None or step.replayed is None or step.replayed.query():
        step.inputs.copy_to_gpu(upto)
        return
    step.upload_stream.wait_event(step.replayed)
    with torch.cuda.stream(step.upload_stream):
        step.inputs.copy_to_gpu(upto)
    torch.cuda.current_stream(step.device).wait_stream(step.upload_stream)


class DecodeGraphs:
    """Captured decode forwards of one model over one KV cache."""

    def __init__(
        self,
        model: CausalLM,
        kv_layers: list[torch.Tensor],
        backend: PagedKernelBackend,
        *,
        max_num_reqs: int,
        max_blocks_per_req: int,
        max_model_len: int,
        device: torch.device | str,
        sizes: tuple[int, ...] = GRAPH_SIZES,
        latest: torch.Tensor | None = None,
        upload_stream: torch.cuda.Stream | None = None,
    ) -> None:
        """`latest`: the device's newest sampled token per batch row (in_flight.PendingFeed),
        which input ids -(row + 1) stand for; `upload_stream`: the stream that copies the inputs;
        `backend`: the runner's attention backend, whose decode kernel the graphs capture."""
        self.model = model
        self.backend = backend
        self.latest = latest
        self.upload_stream = upload_stream
        self.replayed = torch.cuda.Event() if upload_stream is not None else None
        # called with "staged" before a replay and "replayed" after it (the step timeline's
        # marks: ModelRunner.mark_phase)
        self.on_phase: Callable[[str], None] = no_phase
        self.kv_layers = kv_layers
        self.device = torch.device(device)
        self.sizes = graph_sizes(max_num_reqs, sizes)
        self.max_model_len = max_model_len
        self.num_kv_heads = model.config.num_key_value_heads
        rows = self.sizes[-1]
        dev = self.device
        self.inputs = PackedCpuGpuBuffer(
            {
                "input_ids": ((rows,), torch.int64),
                "positions": ((rows,), torch.int64),
                "slots": ((rows,), torch.int64),
                "seq_lens": ((rows,), torch.int32),
                **self.extra_inputs(rows),
                "block_tables": ((rows, max_blocks_per_req), torch.int32),  # last: see _stage
            },
            device=dev,
        )
        self.static = self.inputs.gpu  # the graphs' input tensors, by name
        self.token_index = torch.arange(rows, dtype=torch.int64, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def extra_inputs(self, rows: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Static input fields a subclass adds (staged before the block tables)."""
        return {}

    # -- capture ----------------------------------------------------------------------------

    def metadata(self, size: int) -> TritonAttentionMetadata:
        """Metadata over the static buffers' first `size` rows (what the graph reads)."""
        return TritonAttentionMetadata(
            num_tokens=size,
            slot_mapping=self.static["slots"][:size],
            token_index=self.token_index[:size],
            num_kv_heads=self.num_kv_heads,
            backend=self.backend,
            num_decodes=size,
            decode_block_tables=self.static["block_tables"][:size],
            decode_seq_lens=self.static["seq_lens"][:size],
            decode_max_seq_len=self.max_model_len,
            decode_num_splits=decode_splits(
                size, self.num_kv_heads, self.max_model_len, self.device
            ),
        )

    def forward(self, size: int, meta: TritonAttentionMetadata) -> torch.Tensor:
        # Triton: CUDA builds only
        from meshllm_kernels.decode_chain.token_feed import feed_token_ids_

        ids = self.static["input_ids"][:size]
        if self.latest is not None:
            chain = self.model.decode_chain
            if chain is not None and chain.reads_fed_ids(size):
                meta.fed_tokens = self.latest  # its first kernel reads them (decode_chain.py)
            else:
                feed_token_ids_(ids, self.latest)
        positions = self.static["positions"][:size]
        hidden: torch.Tensor = self.model(ids, positions, meta, self.kv_layers)
        return hidden

    @torch.inference_mode()
    def capture(self) -> float:
        """Capture every size (largest first, sharing one memory pool); returns seconds."""
        self._stage(0, self.sizes[-1], None, None, None, None, None)
        return capture_graphs(self, "decode")

    # -- replay -----------------------------------------------------------------------------

    def fits(self, query_lens: np.ndarray) -> bool:
        """A decode-only step (every request one token) of a captured size."""
        n = len(query_lens)
        return (
            bool(self.graphs)
            and padded_size(n, self.sizes) is not None
            and bool((np.asarray(query_lens) == 1).all())
        )

    def run(
        self,
        input_ids: np.ndarray,
        positions: np.ndarray,
        slot_mapping: np.ndarray,
        seq_lens: np.ndarray,
        block_tables: np.ndarray,
    ) -> torch.Tensor:
        """Replay the graph for len(input_ids) decodes; returns hidden [n, H] (a view of the
        graph's static output: valid until the next replay). An id -(row + 1) stands for
        latest[row], a token the host does not have yet (in_flight.py): the graph's first
        kernel reads it there (meshllm_kernels/decode_chain/token_feed.py)."""
        n = len(input_ids)
        size = self.graph_size(n)
        self._stage(n, size, input_ids, positions, slot_mapping, seq_lens, block_tables)
        self.on_phase("staged")
        self.graphs[size].replay()
        self.on_phase("replayed")
        if self.replayed is not None:
            self.replayed.record()
        return self.outputs[size][:n]

    def graph_size(self, n: int) -> int:
        """The captured size that replays `n` decodes (ValueError: none)."""
        size = padded_size(n, self.sizes)
        if size is None or size not in self.graphs:
            raise ValueError(f"no captured graph holds {n} decodes (sizes {self.sizes})")
        return size

    def _stage(
        self,
        n: int,
        size: int,
        input_ids: np.ndarray | None,
        positions: np.ndarray | None,
        slot_mapping: np.ndarray | None,
        seq_lens: np.ndarray | None,
        block_tables: np.ndarray | None,
    ) -> None:
        """Write rows [0, n) from the step and pad rows [n, size), then upload in one copy
        every field up to the block tables' first `size` rows (the fields before them are
        uploaded whole: a few KB; their rows past `size` are never read by this graph); see
        `upload`."""
        host = self.inputs.host()
        ids, pos, slots = host["input_ids"], host["positions"], host["slots"]
        lens, tables = host["seq_lens"], host["block_tables"]
        if n:
            assert input_ids is not None and positions is not None and slot_mapping is not None
            assert seq_lens is not None and block_tables is not None
            ids[:n], pos[:n], slots[:n], lens[:n] = input_ids, positions, slot_mapping, seq_lens
            width = min(block_tables.shape[1], tables.shape[1])
            tables[:n, :width] = block_tables[:, :width]
        ids[n:size], pos[n:size], slots[n:size], lens[n:size] = 0, 0, -1, 1
        tables[n:size] = 0
        upload(self, self.inputs.end("block_tables", size))
