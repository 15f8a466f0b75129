"""Attention metadata per KV cache group, handed to each layer (shared/kv/groups.py).

Layers of one group share a block table per request, so they share one `AttentionMetadata`:
its slot mapping (where this step's K/V go) is computed from that group's table, and a
sliding-window group's metadata reads only the blocks inside the window. A model with one
full-attention group never comes here (the runner builds its single metadata as before).

A state group (the Mamba2 layers of hybrid models) gets a `StateMetadata` instead: where each
request's recurrent state is read and written (state_metadata.py, the entry rule).

A full-attention group without a window runs the runner's paged Triton kernels when its
backend is one (`paged_attention_groups`: CUDA, a hybrid model's attention layers, which the
decode graphs then capture); sliding-window groups always run the reference path.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from meshllm_kernels.attention.backends import AttentionBackend, PagedKernelBackend
from meshllm_kernels.attention.cpu_decode import CpuDecodeAttention
from services.worker.attention.reference import AttentionMetadata
from services.worker.attention.select import TritonAttentionMetadata
from services.worker.attention.state_metadata import StateMetadata
from shared.kv.groups import KVGroupSpec, layer_group_index


def needs_group_attention(groups: list[KVGroupSpec]) -> bool:
    return len(groups) > 1 or groups[0].kind != "full"


def paged_attention_groups(groups: list[KVGroupSpec]) -> bool:
    """Every attention group is full attention without a window (state groups aside): what
    the paged Triton kernels of one metadata per group serve."""
    return all(g.kind == "state" or g.sliding_window is None for g in groups)


def group_attention(
    groups: list[KVGroupSpec],
    block_tables: np.ndarray,
    rows: np.ndarray,
    query_lens: np.ndarray,
    seq_lens: np.ndarray,
    positions: np.ndarray,
    block_size: int,
    device: torch.device,
    decode_kernel: CpuDecodeAttention | None = None,
    state_triton: bool | None = None,
    backend: AttentionBackend | None = None,
    num_kv_heads: int = 0,
) -> list[AttentionMetadata | TritonAttentionMetadata | StateMetadata]:
    """One metadata per LAYER (layers of a group share the object), for the requests at batch
    `rows` in flat-batch order; block_tables is the batch's [groups, max_reqs, max_blocks].
    `state_triton`: the state layers run the Triton kernels (None: on CUDA; True on CPU runs
    them under Triton's interpreter, as the kernel tests do). `backend`: the runner's; a paged
    one serves the windowless full-attention groups (module docstring), with the model's
    `num_kv_heads` (the decode split factor)."""
    flat_rows = np.repeat(rows, query_lens)
    paged = backend if isinstance(backend, PagedKernelBackend) else None
    per_group: list[AttentionMetadata | TritonAttentionMetadata | StateMetadata] = []
    for g, group in enumerate(groups):
        if group.kind == "ring":  # refused at start-up (backend_choice.refuse_ring_groups)
            raise ValueError(f"group {g}: ring-buffer groups have no attention metadata")
        if group.kind == "state":
            per_group.append(
                StateMetadata.build(
                    block_tables[g, rows],
                    query_lens,
                    seq_lens,
                    block_size,
                    device,
                    triton=state_triton,
                )
            )
            continue
        blocks = block_tables[g, flat_rows, positions // block_size]
        step: dict[str, Any] = dict(
            query_lens=query_lens,
            seq_lens=seq_lens,
            block_tables=block_tables[g, rows],
            block_size=block_size,
            slot_mapping=blocks * block_size + positions % block_size,
            device=device,
        )
        meta: AttentionMetadata | TritonAttentionMetadata
        if paged is not None and group.sliding_window is None:
            meta = TritonAttentionMetadata.build(num_kv_heads=num_kv_heads, backend=paged, **step)
        else:
            meta = AttentionMetadata.build(
                sliding_window=group.sliding_window, decode_kernel=decode_kernel, **step
            )
        per_group.append(meta)
    num_layers = sum(len(g.layer_indices) for g in groups)
    return [per_group[g] for g in layer_group_index(groups, num_layers)]
