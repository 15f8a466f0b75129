"""The worker's KV offload data path (issue #8): KV blocks <-> the Redis tier, with a bounded
host-memory tier in front of it.

Reading order: `payload` (one Redis value per chunk: header + every layer's K and V),
`host_tier` (bounded LRU of payload bytes), `staging` (preallocated host slots, block copies),
`transfer_engine` (store and load threads, the only Redis I/O), `chunks` (which chunks of a
transfer can move), `head_shards` and `group_blocks` (chunks in and out of the KV cache, across
the ranks of a tensor-parallel group), `connector` (what the model runner calls around a
forward), `wiring` (building it from WorkerSettings).
"""
