"""KV cache groups: which layers share one block table, defined once for scheduler and worker.

Layers with the same attention spec (full attention, or a sliding window of W tokens) form one
group. Every layer of a group reads and writes the same positions, so one block table per request
and group describes all of them; layers of different groups need different tables because a
sliding-window group stops referencing blocks that fell out of its window.

Rules both sides keep:

- Order: the full-attention group first (if any layer has full attention), then one group per
  distinct window, windows ascending. Within a group, layer indices ascending. `kv_groups_for`
  is the only place that decides this, so `StepPlan` block-id lists (one per group) line up.
- Window semantics (transformers' `sliding_window_overlay`): a query at position q attends to
  key positions k with q - W < k <= q, i.e. the last W positions including its own.
- Block-list length: for every group, including sliding-window ones (ring groups excepted:
  below), the scheduler keeps a request's block list LENGTH equal to ceil(tokens / block_size),
  so position p always lives in entry p // block_size. Entries whose blocks fell entirely out
  of the window hold the null block id 0 (reserved by the scheduler's block pool, never
  allocated). The worker never reads or writes a position outside the window, so null entries
  are never touched.
- Memory: each attention layer owns one `[2, num_blocks, block_size, kv_heads, head_dim]`
  tensor, whatever its group, and block ids index the per-layer tensors, so all attention
  groups draw from one pool of `num_blocks` ids on the scheduler side.
- An empty group list (`WorkerReady.kv_groups == []`) means one full-attention group over every
  layer: what workers announced before groups existed.

State groups (`kind="state"`: the Mamba-style layers of hybrid models) keep, per request, one
recurrent state instead of per-token K/V, in block ids of their own state pool ("align mode":
a state saved at each block boundary, so prefix caching works for hybrids):

- Entry rule: after a request's first n tokens are computed, its state lives in block-table
  entry `ceil(n / block_size) - 1`, the entry of the block holding position n - 1. When n is a
  multiple of `block_size` that block is full and its state is the state after exactly the
  tokens its block hash names: a prefix-cache hit of h tokens needs only entry h/block_size - 1.
- A step computing positions n .. m - 1 reads the state from entry ceil(n / block_size) - 1
  (a zero state when n == 0), writes the state at every block boundary k * block_size inside
  (n, m] into entry k - 1, and the final state into entry ceil(m / block_size) - 1. A full block
  is never written by a step that starts at or after its end (cached blocks stay immutable).
- The scheduler keeps the entries from the one holding position n - 1 on and swaps every
  earlier one for the null block (a sliding window of 2 positions, in effect), so a request
  holds at most ceil((1 + step tokens) / block_size) + 1 state blocks, whatever its length.
- Memory: each state layer owns per-block state tensors (a conv state and an SSM state per
  block id) of `num_state_blocks` blocks (WorkerReady), a pool apart from the attention pool's
  `num_blocks`: a state group's ids index the state pool only, with its own null block 0, and
  the scheduler hands them out of a BlockPool of its own (services/scheduler/kv). A state
  block costs what thousands of attention tokens cost, so the worker sizes the state pool by
  a rule (services/worker/runner/state_pool.py) instead of a state per attention block id.
  (`num_state_blocks == 0` with a state group: a worker from before the state pool, whose
  state groups share the attention pool's ids.)
- Order: state groups come after the attention groups (one state group: every state layer
  has the same state shape in the supported families).
- State groups are transferable (P/D hands them over) but not storable: the Redis tier's
  prefix cache (role "both") hashes and stores attention groups only; a prefill role also
  stores the state block at the end of each offer and a decode role loads the one ending at
  its hit (services/scheduler/offload/connector.py, `transfer_state`). A state chunk's payload
  is the block id's conv + SSM state of every state layer (services/worker/kv_offload/payload.py).

Ring groups (`kind="ring"`, `ring_size` R: a layer whose cache is a circular buffer of R token
slots per request, declared per layer as `Ring(R)`) keep only the most recent positions, written
in place over the oldest:

- Slot rule: with n = ceil(R / block_size) ring blocks, position p lives in block-table entry
  (p // block_size) % n at offset p % block_size, i.e. in slot p % (n * block_size) of the
  ring (slot p % R when block_size divides R; otherwise the ring is R rounded up to whole
  blocks, and holds at least the last R positions).
- Block-list length: unlike every other kind, the table does NOT grow with the sequence: it
  holds min(ceil(tokens / block_size), n) entries, allocated as positions first reach them and
  never replaced, so a request holds at most n ring blocks however long it runs. Entry i for
  i >= n is never sent; the worker maps a position to its entry by the slot rule.
- Reads: a query at q reads the last R positions (q - R < k <= q). A step computing several
  positions overwrites slots older positions of the same step still need, so an implementation
  must read the ring's older positions before the step's writes land (or attend to the step's
  own K/V from its inputs): the entry holding position p - n * block_size is the one p reuses.
- Memory: ring layers' block ids index the attention pool (`num_blocks`), like full and
  sliding-window groups.
- Not prefix-cacheable: the contents of a ring block depend on which of the positions that map
  to it was written last, which no block hash names, so a ring group never serves a prefix
  hit (a model with a ring layer always starts from 0 in the local prefix cache) and the
  tier's prefix cache never stores or looks one up. Transferable: P/D hands the ring over like
  a sliding window of R positions (services/scheduler/offload/connector.py).
- Order: ring groups after the sliding-window groups (ring sizes ascending), before the state
  groups. No supported model family has a ring layer yet: the worker refuses a ring group at
  start-up rather than run it as something else.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, model_validator

KVGroupKind = Literal["full", "sliding_window", "state", "ring"]


class Ring(NamedTuple):
    """A ring-buffer layer's cache kind for `kv_groups_for`: a circular buffer of `ring_size`
    token slots per request (see the module docstring)."""

    ring_size: int


#: Per-layer cache kind for `kv_groups_for`: None = full attention, an int = a sliding window of
#: that many positions, STATE = a recurrent-state (Mamba-style) layer, Ring(R) = a ring buffer
#: of R slots.
STATE: Literal["state"] = "state"
LayerCache = int | None | Literal["state"] | Ring


class KVGroupSpec(BaseModel):
    """One KV cache group: its kind (full / sliding window / state / ring), window (sliding
    only), ring size (ring only) and member layers."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: KVGroupKind
    sliding_window: int | None = Field(default=None, ge=1)
    ring_size: int | None = Field(default=None, ge=1)
    layer_indices: list[int]

    @model_validator(mode="after")
    def _window_matches_kind(self) -> KVGroupSpec:
        if (self.kind == "sliding_window") != (self.sliding_window is not None):
            raise ValueError(
                f"kind={self.kind!r} with sliding_window={self.sliding_window}: a window is "
                "given exactly for sliding_window groups"
            )
        if (self.kind == "ring") != (self.ring_size is not None):
            raise ValueError(
                f"kind={self.kind!r} with ring_size={self.ring_size}: a ring size is given "
                "exactly for ring groups"
            )
        if not self.layer_indices:
            raise ValueError("a KV cache group holds at least one layer")
        return self


def kv_groups_for(layer_windows: list[LayerCache]) -> list[KVGroupSpec]:
    """Groups for per-layer cache kinds (None = full attention, int = window, Ring(R) = ring
    buffer, STATE = state layer), in the canonical order."""
    if not layer_windows:
        raise ValueError("a model has at least one layer")
    by_window: dict[int | None, list[int]] = {}
    by_ring: dict[int, list[int]] = {}
    state_layers: list[int] = []
    for layer, window in enumerate(layer_windows):
        if isinstance(window, str):  # STATE
            state_layers.append(layer)
            continue
        if isinstance(window, Ring):
            if window.ring_size < 1:
                raise ValueError(f"layer {layer}: ring size {window.ring_size} must be >= 1")
            by_ring.setdefault(window.ring_size, []).append(layer)
            continue
        if window is not None and window < 1:
            raise ValueError(f"layer {layer}: sliding window {window} must be >= 1")
        by_window.setdefault(window, []).append(layer)
    groups: list[KVGroupSpec] = []
    if None in by_window:
        groups.append(KVGroupSpec(kind="full", layer_indices=by_window.pop(None)))
    for window in sorted(w for w in by_window if w is not None):
        layers = by_window[window]
        spec = KVGroupSpec(kind="sliding_window", sliding_window=window, layer_indices=layers)
        groups.append(spec)
    for size in sorted(by_ring):
        groups.append(KVGroupSpec(kind="ring", ring_size=size, layer_indices=by_ring[size]))
    if state_layers:
        groups.append(KVGroupSpec(kind="state", layer_indices=state_layers))
    return groups


def layer_group_index(groups: list[KVGroupSpec], num_layers: int) -> list[int]:
    """group index of every layer (the inverse of `layer_indices`); checks the groups cover
    each layer exactly once."""
    owner = [-1] * num_layers
    for g, group in enumerate(groups):
        for layer in group.layer_indices:
            if not 0 <= layer < num_layers or owner[layer] != -1:
                raise ValueError(f"layer {layer} is out of range or in two KV cache groups")
            owner[layer] = g
    if -1 in owner:
        raise ValueError(f"layer {owner.index(-1)} is in no KV cache group")
    return owner
