"""One rank's KV cache as offload chunks: whole chunks out of the group's blocks (stores) and
whole chunks into them (loads), the same calls on every rank of a tensor-parallel group.

Rank 0's connector (connector.py) and every other rank's `KVFollower` hold one of these. A
store's chunks come out of each rank's cache as its head shard and arrive at rank 0 whole
(head_shards.py); a load's whole chunks leave rank 0 and each rank writes its heads. At TP=1
both are plain copies. Which chunks move is decided the same way on every rank: stores from
the plan every rank ran (`store_groups`), loads from the list rank 0 sends its followers.
"""

from __future__ import annotations

import torch

from services.worker.attention.context_kv import context_kv_writer
from services.worker.kv_offload.chunks import Chunk, ChunkCheck, by_group
from services.worker.kv_offload.head_shards import KVHeadShards
from services.worker.kv_offload.staging import scatter_blocks, take_blocks
from services.worker.runner.kv_cache import KVCache
from shared.kv.offload_key import KeySpace
from shared.protocol import KVTransfer, StepPlan

LoadBlocks = list[tuple[int, list[int]]]  # one load's (group, block ids) per group, in order


class GroupKVBlocks:
    def __init__(
        self,
        kv_cache: KVCache,
        key_space: KeySpace,
        shards: KVHeadShards,
        layer_groups: list[list[int]] | None = None,
    ) -> None:
        groups = layer_groups or [list(range(len(kv_cache.layers)))]
        self.group_layers = [[_kv_tensor(kv_cache, i) for i in layers] for layers in groups]
        first = kv_cache.layers[groups[0][0]]  # an attention layer's K/V tensor
        assert isinstance(first, torch.Tensor), "KV offload groups hold attention layers only"
        _, _, self.block_size, local_heads, self.head_dim = first.shape
        if local_heads != len(shards.local):
            raise ValueError(
                f"the cache holds {local_heads} KV heads, rank {shards.tp.rank} of the split "
                f"{shards.ranges} holds {len(shards.local)}"
            )
        self.num_layers = [len(g) for g in groups]
        self.shards = shards
        self.dtype = first.dtype
        self.device = first.device
        self.write_kv = context_kv_writer(self.device)
        self.check = ChunkCheck(key_space, len(groups), kv_cache.num_blocks)

    def chunk_shape(self, group: int) -> tuple[int, int, int, int, int]:
        """A payload body of `group`: [layers, 2, block_size, all KV heads, head_dim]."""
        return (self.num_layers[group], 2, self.block_size, self.shards.num_heads, self.head_dim)

    def store_groups(
        self, transfer: KVTransfer
    ) -> tuple[dict[int, list[Chunk]], list[str], str | None]:
        """The transfer's valid chunks per group (the order every rank gathers them in), and
        the keys no rank can store with the first reason."""
        valid, failed, reason = self.check.split(transfer)
        return by_group(valid), failed, reason

    def gather(self, group: int, block_ids: list[int]) -> torch.Tensor | None:
        """A collective: whole chunks of `block_ids` [n, *chunk_shape] on rank 0 (the cache's
        device), None elsewhere."""
        return self.shards.gather(take_blocks(self.group_layers[group], block_ids))

    def insert(self, group: int, block_ids: list[int], chunks: torch.Tensor | None) -> None:
        """A collective: rank 0's whole `chunks` [n, *chunk_shape] (None elsewhere) into blocks
        `block_ids`, each rank writing its own heads."""
        leading = (len(block_ids), self.num_layers[group], 2, self.block_size)
        local = self.shards.scatter(chunks, leading, self.head_dim, self.dtype, self.device)
        scatter_blocks(self.group_layers[group], block_ids, local, self.write_kv)


class KVFollower:
    """Ranks 1..N-1 of a group with KV offload: the runner's connector there. They hold no
    Redis connection and report nothing; they only take part in rank 0's collectives."""

    def __init__(self, blocks: GroupKVBlocks) -> None:
        assert blocks.shards.tp.rank != 0, "rank 0 runs the KVConnector"
        self.blocks = blocks

    def before_forward(self, plan: StepPlan) -> None:
        """Loads are applied when rank 0 says so (`apply_loads`), never inside a step."""

    def after_forward(self, plan: StepPlan) -> None:
        """This rank's shard of every chunk rank 0 stores from the plan (connector.py)."""
        for transfer in plan.kv_stores:
            groups, _, _ = self.blocks.store_groups(transfer)
            for group, chunks in groups.items():
                self.blocks.gather(group, [block for _, _, block in chunks])

    def apply_loads(self, loads: list[LoadBlocks]) -> None:
        for load in loads:
            for group, block_ids in load:
                self.blocks.insert(group, block_ids, None)

    def reset(self) -> None:
        """Nothing is pending here: rank 0 holds every transfer's state."""


def _kv_tensor(kv_cache: KVCache, layer: int) -> torch.Tensor:
    """An attention layer's K/V tensor (offload groups never hold state layers: wiring.py)."""
    tensor = kv_cache.layers[layer]
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"layer {layer} is a state layer: the KV offload tier stores K/V only")
    return tensor
