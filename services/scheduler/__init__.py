"""The scheduler: engine core (queues, KV block manager, prefix cache, admission, chunked
prefill, preemption, stop checks) and, in `service.py`, its bus edge.

Core modules read bottom-up: `block_hash` -> `kv_cache_spec` -> `block_pool` ->
`single_type_manager` -> `kv_cache_coordinator` -> `kv_cache_manager` -> `request`, `stop` ->
`scheduler`. None of them imports redis or fastapi.
"""
