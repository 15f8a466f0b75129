"""The worker's paged KV cache tensors, sized from a byte budget.

Layout of one layer: `[2, num_blocks, block_size, num_kv_heads, head_dim]`, index 0 = K, 1 = V.
A block holds `block_size` consecutive positions of one request; token position p of a request
with block table `bt` lives in slot `bt[p // block_size] * block_size + p % block_size`, i.e.
row `slot` of the `[2, num_blocks * block_size, num_kv_heads, head_dim]` view. Block ids are
chosen by the scheduler's block pool; the worker never allocates blocks, it only sizes the pool
(`num_blocks`, announced in WorkerReady) and stores into what the plans name.

Hybrid models (attention + Mamba2 layers): a state layer's entry in `layers` is a `MambaState`
(state_cache.py: per-block conv and SSM states) instead of a K/V tensor; `attention_layers`
lists the others. The two kinds are two pools with their own block counts and id spaces:
attention tensors hold `num_blocks` blocks (the state group's ids never index them), state
tensors `num_state_blocks` (indexed by the state group's ids only; announced in WorkerReady
beside `num_blocks`). `bytes_per_block` counts attention only, `state_block_bytes` one state
block of every state layer; state_pool.py sizes the state pool out of the budget.

The tensors start zeroed (lazily, on CPU: untouched pages cost nothing), so the padding that the
batched decode path gathers past a sequence's end is finite and masked out, never NaN.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from services.worker.runner.state_cache import MambaState, state_bytes_per_block
from shared.model.config import ModelConfig

LayerCache = torch.Tensor | MambaState


class KVCacheSizeError(ValueError):
    """The budget does not hold even one block per layer."""


def available_memory_bytes(device: torch.device) -> int:
    """Memory the KV cache may come from: MemAvailable on CPU, free device memory on CUDA
    (call after the weights are loaded, so they are already subtracted)."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/meminfo has no MemAvailable")


def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """K and V of one block across every attention layer (state layers are in the state
    pool: `state_block_bytes`)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    per_layer = 2 * block_size * config.num_key_value_heads * config.head_dim * itemsize
    return per_layer * len(config.attention_layers)


def state_block_bytes(config: ModelConfig, dtype: torch.dtype) -> int:
    """One block of the state pool: the conv + SSM state of every state layer (0 without
    state layers)."""
    if config.mamba is None:
        return 0
    return state_bytes_per_block(config.mamba, dtype) * len(config.mamba_layers)


def cache_budget(
    device: torch.device | str, kv_cache_bytes: int = 0, memory_fraction: float = 0.3
) -> int:
    """Bytes for the KV cache: `kv_cache_bytes` if > 0, else `memory_fraction` of the
    available memory."""
    return kv_cache_bytes or int(available_memory_bytes(torch.device(device)) * memory_fraction)


def budget_blocks(
    config: ModelConfig,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
    kv_cache_bytes: int = 0,
    memory_fraction: float = 0.3,
    num_state_blocks: int = 0,
) -> int:
    """Attention blocks the budget (`cache_budget`) holds beside `num_state_blocks` state
    blocks; at least one, or KVCacheSizeError."""
    budget = cache_budget(device, kv_cache_bytes, memory_fraction)
    budget -= num_state_blocks * state_block_bytes(config, dtype)
    per_block = bytes_per_block(config, block_size, dtype)
    if budget // per_block < 1:
        raise KVCacheSizeError(
            f"KV cache budget of {budget} bytes holds no block "
            f"(one block of {block_size} tokens needs {per_block} bytes"
            + (f", beside {num_state_blocks} state blocks)" if num_state_blocks else ")")
        )
    return budget // per_block


@dataclass
class KVCache:
    # per layer: [2, num_blocks, block_size, kv_heads, head_dim] (attention) or its MambaState
    # ([num_state_blocks, ...] states)
    layers: list[LayerCache]
    num_blocks: int
    block_size: int
    num_state_blocks: int = 0  # the state pool's blocks (0: no state layers)

    @classmethod
    def allocate(
        cls,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
        num_state_blocks: int | None = None,
    ) -> KVCache:
        """`num_state_blocks`: the state pool of a model with state layers (None: as many as
        `num_blocks`, for tests and tools; the worker sizes it by state_pool.py). A model
        without state layers has none."""
        if num_blocks < 1 or block_size < 1:
            raise KVCacheSizeError(f"num_blocks={num_blocks}, block_size={block_size}")
        state_layers = set(config.mamba_layers)
        if not state_layers:
            num_state_blocks = 0
        elif num_state_blocks is None:
            num_state_blocks = num_blocks
        elif num_state_blocks < 1:
            raise KVCacheSizeError(f"num_state_blocks={num_state_blocks} with state layers")
        shape = (2, num_blocks, block_size, config.num_key_value_heads, config.head_dim)
        layers: list[LayerCache] = [
            MambaState.allocate(config.mamba, num_state_blocks, dtype, device)  # type: ignore[arg-type]
            if i in state_layers
            else torch.zeros(shape, dtype=dtype, device=device)
            for i in range(config.num_hidden_layers)
        ]
        return cls(layers, num_blocks, block_size, num_state_blocks)

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def attention_layers(self) -> list[torch.Tensor]:
        """The per-token K/V tensors (every layer's, for a model without state layers)."""
        return [t for t in self.layers if isinstance(t, torch.Tensor)]

    @property
    def dtype(self) -> torch.dtype:
        return self.layers[0].dtype

    @property
    def nbytes(self) -> int:
        return sum(
            t.nbytes if isinstance(t, MambaState) else t.numel() * t.element_size()
            for t in self.layers
        )
