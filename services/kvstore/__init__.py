"""The kvstore: the KV offload tier's policy state (which chunks exist, recency, pins).

Reads top-down:
- names: `offload_key` (OffloadKey, KeySpace: Redis key names per model and layout version);
- the pure core: `chunk_table` (status and sizes), `policy` (the interface, `load_policy`),
  `lru` (ranks + lazy heap), `request_record` (one access per request), `offload_tier` (the
  lifecycle: store, stored, load, loaded, request_finished);
- scheduler-side helpers, pure too: `async_lookup` (shared in-flight probes),
  `sliding_window` (the window scanner and coverage);
- the edge: `redis_index` (metadata, eviction deletes, recovery), `http_api` (/v1/kv/*),
  `service`, and `client` for callers.
"""
