"""KV cache names shared by scheduler, worker and kvstore: block hashes, groups, offload keys."""
