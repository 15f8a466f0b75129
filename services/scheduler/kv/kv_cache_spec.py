"""KV cache specs and groups.

Every attention-like layer declares a spec; layers with equal specs form a KV cache group; each
group gets its own block manager (see `single_type_manager`), and all groups draw physical
blocks from ONE block pool. Full attention and sliding window exist; state (Mamba) specs would
be new subclasses with their own managers, without touching the pool.

All groups share one block size for now, so one chained hash list per request serves every
group (the pool keys cached blocks by (hash, group id), since the same prefix has a different
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
        """Whether blocks hold hash-addressable prefix data (ring buffers do not)."""
        return False


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


AttentionSpec = Annotated[FullAttentionSpec | SlidingWindowSpec, Field(discriminator="kind")]


class KVCacheGroup(BaseModel):
    """Layers sharing one spec (and so one block table per request)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    spec: AttentionSpec
    layer_names: tuple[str, ...] = ()
