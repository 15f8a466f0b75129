"""How a hybrid model's KV budget is split between the attention pool and the state pool.

A state block (one recurrent state per state layer: state_cache.py) costs what thousands of
attention tokens cost, and a request holds only a few of them (shared/kv/groups.py: the block
of its last computed position, and while a step computes it the boundary states inside the
step), so the state layers get their own pool (`num_state_blocks`, SGLang's MambaPool beside
its KV pool) instead of a state per attention block id.

The rule (`state_pool_blocks`): `MESHLLM_KV_STATE_BLOCKS` if set (> 0; refused if it leaves no
attention block), else `max(floor, floor(share * budget / state_block_bytes))`, cut to
`MAX_SHARE` of the budget, where

- `share` = `MESHLLM_KV_STATE_MEMORY_SHARE` (0.5: about SGLang's default, whose Mamba pool is
  0.9 times its KV pool): what the budget gives states beyond the floor holds prefix-cached
  boundary states;
- `floor = 2 * max_num_seqs + ceil(max_num_batched_tokens / block_size) + 2`: every running
  request's two blocks (the state read and the one being written), the boundary states one
  step writes (its tokens over all requests, one per block), and the null block plus one to
  spare. `max_num_seqs` and `max_num_batched_tokens` are the scheduler's
  `MESHLLM_MAX_NUM_SEQS` / `MESHLLM_MAX_NUM_BATCHED_TOKENS`, read from the same variables.
  With fewer state blocks the scheduler still serves, but preempts more and refuses prompts
  whose prefill chunk needs more states than the pool holds;
- `MAX_SHARE` (0.9) keeps a small budget serving: there the floor is cut (the worker warns)
  and attention keeps the rest.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.worker.runner.kv_cache import KVCacheSizeError

MAX_SHARE = 0.9  # of the budget the rule gives states at most


class StatePoolSizeError(KVCacheSizeError):
    """The budget cannot hold the state pool asked for beside one attention block."""


@dataclass(frozen=True)
class StatePoolPolicy:
    blocks: int = 0  # an explicit state block count (null block included); 0 = the rule
    share: float = 0.5  # of the budget for states, beyond the floor
    max_num_seqs: int = 64  # running requests the floor provides for
    max_num_batched_tokens: int = 2048  # tokens of one step (its boundary states)

    def __post_init__(self) -> None:
        if self.blocks < 0 or self.blocks == 1:
            raise ValueError(f"state blocks are 0 (the rule) or at least 2, got {self.blocks}")
        if not 0 <= self.share <= MAX_SHARE:
            raise ValueError(f"the state share of the budget is in [0, {MAX_SHARE}]: {self.share}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")

    def floor(self, block_size: int) -> int:
        return 2 * self.max_num_seqs + -(-self.max_num_batched_tokens // block_size) + 2


def state_pool_blocks(
    policy: StatePoolPolicy,
    budget: int,
    block_size: int,
    state_block_bytes: int,
    attention_block_bytes: int,
) -> int:
    """State blocks for a budget of `budget` bytes (see the module docstring); at least one
    attention block still fits beside them."""
    if state_block_bytes <= 0:
        raise ValueError("a model without state layers has no state pool")
    if policy.blocks:
        blocks = policy.blocks
    else:
        wanted = max(policy.floor(block_size), int(budget * policy.share) // state_block_bytes)
        blocks = min(wanted, int(budget * MAX_SHARE) // state_block_bytes)
    if blocks < 2 or budget - blocks * state_block_bytes < attention_block_bytes:
        raise StatePoolSizeError(
            f"a state pool of {blocks} blocks ({state_block_bytes} bytes each) and one "
            f"attention block ({attention_block_bytes} bytes) do not fit a KV cache budget of "
            f"{budget} bytes: raise MESHLLM_KV_CACHE_BYTES (or "
            "MESHLLM_KV_CACHE_MEMORY_FRACTION), or lower MESHLLM_KV_STATE_BLOCKS"
        )
    return blocks
