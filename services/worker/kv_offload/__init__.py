"""The worker's KV offload data path (issue #8): KV blocks <-> the Redis tier, with a bounded
host-memory tier in front of it.

Reading order: `payload` (one Redis value per chunk: header + every layer's K and V),
`host_tier` (bounded LRU of payload bytes), `staging` (preallocated host slots, block copies),
`transfer_engine` (store and load threads, the only Redis I/O), `connector` (what the model
runner calls around a forward), `wiring` (building it from WorkerSettings).
"""
