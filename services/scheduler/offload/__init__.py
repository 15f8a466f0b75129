"""The scheduler's side of the KV offload tier (CONTRACTS.md, KV offload tier): pure core.

Reads top-down:
- `request_state`: what one request did with the tier (keys offered or loaded with their end
  positions, the load in flight, how far its blocks were offered);
- `load_allocation`: blocks for a load, allocated like an admission but NOT registered in the
  prefix cache until the load completed (the estimate equals the allocation);
- `connector`: the decisions: lookups on a local prefix miss (defer / load / compute), the
  loads and store offers of a plan, load completion (ok: blocks computed and cached; failed:
  freed, keys forced misses, recompute), blocks kept under an in-flight load after an abort.

The I/O edge (kvstore HTTP calls, probe tasks, KVTransferDone dispatch, metrics) is
`services.scheduler.offload.edge`; this package never does I/O.
"""
