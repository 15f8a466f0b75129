"""The kvstore: the KV offload tier's policy state (which chunks exist, recency, pins).

Reads top-down:
- the pure core: `chunk_table` (status and sizes), `policy` (the interface, `load_policy`),
  `lru` (ranks + lazy heap), `request_record` (one access per request), `offload_tier` (the
  lifecycle: store, stored, load, loaded, request_finished);
- the edge: `redis_index` (metadata, eviction deletes, recovery), `calls` (the calls the
  scheduler makes over the bus, shared/protocol/kvstore.py), `service`.
Key names (OffloadKey, KeySpace) are shared with the scheduler and worker: shared/kv.
"""
