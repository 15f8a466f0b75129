"""What one request did with the offload tier, kept by the connector while the request lives.

Recency is committed by the kvstore once per request (CONTRACTS.md); what the scheduler owes it
is each key it loaded or offered, with the key's end position (the tokens its prefix covers).
Those reports go out with the kvstore calls themselves (`load` pins, `store` offers); the state
here remembers how far they went, so no key is offered twice by one request.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.kv.offload_key import OffloadKey
from shared.protocol.kv_transfer import KVTransfer


@dataclass
class LoadJob:
    """One load in flight: the request's blocks [first_block, first_block + num_blocks) of each
    prefix-cacheable group are being filled from the tier. Until the worker answers, the
    request computes nothing and its blocks are never freed (the worker writes into them)."""

    transfer: KVTransfer
    keys: list[tuple[OffloadKey, int]]  # (key, end position), head first
    first_block: int
    num_blocks: int
    num_tokens: int  # computed tokens once the load is done (local hit + loaded)
    local_hit_tokens: int

    @property
    def loaded_tokens(self) -> int:
        return self.num_tokens - self.local_hit_tokens


@dataclass
class OffloadRequestState:
    request_id: str
    # Leading blocks whose keys were offered for store or loaded: never offered again.
    offered_blocks: int = 0
    keys_looked_up: int = 0  # leading blocks whose keys are attached to the async lookup
    load: LoadJob | None = None
    # Computed tokens of a finished load, until the request is admitted with them (it holds
    # its blocks meanwhile, with `num_computed_tokens` kept at 0 so admission counts them once).
    resumed_tokens: int = 0
    defers: int = 0
    holds: int = 0  # steps it waited for another request's load of its next block
    loaded: list[tuple[OffloadKey, int]] = field(default_factory=list)
    offered: list[tuple[OffloadKey, int]] = field(default_factory=list)

    def recorded(self) -> list[tuple[OffloadKey, int]]:
        """Every key this request reported to the tier, with its end position."""
        return [*self.loaded, *self.offered]
