"""KV cache specs and groups.

Every attention-like layer declares a spec; layers with equal specs form a KV cache group; each
group gets its own block manager (see `single_type_manager`). Attention groups (full attention,
sliding window, ring buffer) draw physical blocks from the attention pool; recurrent-state
groups (the Mamba-style layers of hybrid models, shared/kv/groups.py's "align mode") from a
state pool of their own when the worker announced one (`num_state_blocks`), else from the
attention pool too.

All groups share one block size for now, so one chained hash list per request serves every
group (a pool keys cached blocks by (hash, group id), since the same prefix has a different
physical block in each group).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field


class KVCacheSpec(BaseModel):
    """What one group of layers needs from the KV cache."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    block_size: int = Field(default=16, ge=1)

    @property
    def prefix_cacheable(self) -> bool:
        """Whether blocks hold hash-addressable prefix data the offload tier may store (ring
        buffers and recurrent states do not)."""
        return False

    @property
    def locally_cacheable(self) -> bool:
        """Whether the scheduler's own prefix cache may register and reuse full blocks."""
        return self.prefix_cacheable

    @property
    def transferable(self) -> bool:
        """Whether a P/D handoff may ship the group's blocks (every kind: a handoff moves one
        request's KV at one point of its sequence, which needs no hash to name its contents)."""
        return True


class FullAttentionSpec(KVCacheSpec):
    """Every token attends to every earlier token: a request needs one slot per token, and any
    run of full blocks from the start is a reusable prefix."""

    kind: Literal["full_attention"] = "full_attention"

    @property
    def prefix_cacheable(self) -> bool:
        return True


class SlidingWindowSpec(KVCacheSpec):
    """The token at position p attends to positions p - sliding_window + 1 .. p (itself
    included, as transformers masks Mistral/Qwen2/Gemma): a block whose every position is below
    the window of the next token to compute is never read again and goes back to the pool.

    Prefix-cacheable: a hit of h tokens only needs the `sliding_window - 1` positions before h
    (the window of the token at h), so a hit is a run of cached blocks ENDING at h.
    """

    kind: Literal["sliding_window"] = "sliding_window"
    sliding_window: int = Field(ge=1)

    @property
    def prefix_cacheable(self) -> bool:
        return True


class StateSpec(KVCacheSpec):
    """Recurrent-state layers (Mamba-style): one state per request, kept in the block of its
    last computed position, with the state at each block boundary left in that full block (the
    entry rule of shared/kv/groups.py). A hit of h tokens needs only the block ending at h, and
    a request holds a bounded number of blocks, as a sliding window of 2 positions does.

    Locally reusable at block boundaries, but not prefix-cacheable in the tier's sense: the
    Redis tier hashes and stores attention K/V only ("transferable is not storable")."""

    kind: Literal["state"] = "state"

    #: The positions a state block stands for, in sliding-window terms: the next token reads the
    #: state kept with position n - 1 and nothing before it.
    @property
    def sliding_window(self) -> int:
        return 2

    @property
    def locally_cacheable(self) -> bool:
        return True


class RingSpec(KVCacheSpec):
    """A ring buffer of `ring_size` token slots per request (shared/kv/groups.py's slot rule):
    position p lives in table entry (p // block_size) % n_ring_blocks, so a request holds at
    most `n_ring_blocks` blocks, written over in place, however long it runs.

    Neither prefix-cacheable nor locally cacheable: a ring block's contents depend on which of
    the positions mapped to it was written last, which no block hash names, so it can never
    serve a hit. Transferable all the same (P/D ships the ring at the handoff point)."""

    kind: Literal["ring"] = "ring"
    ring_size: int = Field(ge=1)

    @property
    def n_ring_blocks(self) -> int:
        """Blocks of the ring: its slots rounded up to whole blocks."""
        return -(-self.ring_size // self.block_size)


AttentionSpec = Annotated[
    FullAttentionSpec | SlidingWindowSpec | StateSpec | RingSpec, Field(discriminator="kind")
]


class KVCacheGroup(BaseModel):
    """Layers sharing one spec (and so one block table per request)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    spec: AttentionSpec
    layer_names: tuple[str, ...] = ()
