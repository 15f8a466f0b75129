"""One rank's KV cache as offload chunks: whole chunks out of the group's blocks (stores) and
whole chunks into them (loads), the same calls on every rank of a tensor-parallel group.

Rank 0's connector (connector.py) and every other rank's `KVFollower` hold one of these. A
store's chunks come out of each rank's cache as its head shard and arrive at rank 0 whole
(head_shards.py); a load's whole chunks leave rank 0 and each rank writes its heads. At TP=1
both are plain copies. Which chunks move is decided the same way on every rank: stores from
the plan every rank ran (`store_groups`), loads from the list rank 0 sends its followers.

State groups (a hybrid model's Mamba layers, after every attention group; moved by P/D only,
shared/kv/groups.py): a chunk is one block id's recurrent state in every layer of the group
(the id indexes the state pool: kv_cache.py),
`[layers, 1, 1, 1, state_elems]` (per layer its conv state then its SSM state, flattened, in
the pool's dtype: payload.py). Only at TP=1 (wiring.py leaves them out when sharded).
"""

from __future__ import annotations

import torch

from services.worker.attention.context_kv import context_kv_writer
from services.worker.kv_offload.chunks import Chunk, ChunkCheck, by_group
from services.worker.kv_offload.head_shards import KVHeadShards
from services.worker.kv_offload.staging import scatter_blocks, take_blocks
from services.worker.runner.kv_cache import KVCache
from services.worker.runner.state_cache import MambaState
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
        # Per group: its layers' K/V tensors, or (a state group) their per-block states.
        self.state_layers: dict[int, list[MambaState]] = {}
        self.group_layers: list[list[torch.Tensor]] = []
        for g, layers in enumerate(groups):
            entries = [kv_cache.layers[i] for i in layers]
            if all(isinstance(e, MambaState) for e in entries):
                if shards.sharded:
                    raise ValueError("state groups move at TP=1 only (their heads are split)")
                self.state_layers[g] = entries  # type: ignore[assignment]
                self.group_layers.append([])
                continue
            self.group_layers.append([_kv_tensor(kv_cache, i) for i in layers])
        first = kv_cache.layers[groups[0][0]]  # an attention layer's K/V tensor
        assert isinstance(first, torch.Tensor), "the first KV offload group holds attention"
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
        self.check = ChunkCheck(
            key_space,
            len(groups),
            kv_cache.num_blocks,
            frozenset(self.state_layers),
            kv_cache.num_state_blocks,
        )

    def is_state(self, group: int) -> bool:
        return group in self.state_layers

    def group_dtype(self, group: int) -> torch.dtype:
        states = self.state_layers.get(group)
        return states[0].dtype if states else self.dtype

    def chunk_shape(self, group: int) -> tuple[int, int, int, int, int]:
        """A payload body of `group`: [layers, 2, block_size, all KV heads, head_dim], or for a
        state group [layers, 1, 1, 1, state_elems] (conv state then SSM state per layer)."""
        states = self.state_layers.get(group)
        if states is not None:
            return (len(states), 1, 1, 1, state_elems(states[0]))
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
        states = self.state_layers.get(group)
        if states is not None:
            return take_states(states, block_ids)
        return self.shards.gather(take_blocks(self.group_layers[group], block_ids))

    def insert(self, group: int, block_ids: list[int], chunks: torch.Tensor | None) -> None:
        """A collective: rank 0's whole `chunks` [n, *chunk_shape] (None elsewhere) into blocks
        `block_ids`, each rank writing its own heads."""
        states = self.state_layers.get(group)
        if states is not None:
            assert chunks is not None  # state groups move at TP=1 only
            put_states(states, block_ids, chunks)
            return
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


def state_elems(state: MambaState) -> int:
    """Elements of one block id's state in one layer: its conv state, then its SSM state."""
    return state.conv[0].numel() + state.ssm[0].numel()


def take_states(states: list[MambaState], block_ids: list[int]) -> torch.Tensor:
    """Blocks `block_ids` of the state layers `states` as state chunks
    [n, layers, 1, 1, 1, state_elems] (a copy, on the states' device)."""
    blocks = torch.tensor(block_ids, dtype=torch.int64, device=states[0].conv.device)
    n = len(block_ids)
    per_layer = [
        torch.cat([state.conv[blocks].reshape(n, -1), state.ssm[blocks].reshape(n, -1)], dim=1)
        for state in states
    ]
    return torch.stack(per_layer, dim=1).view(n, len(states), 1, 1, 1, -1)


def put_states(states: list[MambaState], block_ids: list[int], chunks: torch.Tensor) -> None:
    """Write state chunks [n, layers, 1, 1, 1, state_elems] into blocks `block_ids` of the
    state layers `states`: the inverse of `take_states`."""
    device = states[0].conv.device
    blocks = torch.tensor(block_ids, dtype=torch.int64, device=device)
    n = len(block_ids)
    flat = chunks.to(device).reshape(n, len(states), -1)
    for i, state in enumerate(states):
        conv_elems = state.conv[0].numel()
        state.conv[blocks] = flat[:, i, :conv_elems].reshape(n, *state.conv.shape[1:])
        state.ssm[blocks] = flat[:, i, conv_elems:].reshape(n, *state.ssm.shape[1:])


def _kv_tensor(kv_cache: KVCache, layer: int) -> torch.Tensor:
    """An attention layer's K/V tensor (offload groups never hold state layers: wiring.py)."""
    tensor = kv_cache.layers[layer]
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"layer {layer} is a state layer: the KV offload tier stores K/V only")
    return tensor
