"""Tensor parallelism inside one worker group (MESHLLM_TP=N): N rank processes, one model.

Reading order: `group` (the process group and the collectives the layers call), `shard_config`
(the ModelConfig of one rank's shard: its heads, KV heads and intermediate sizes), `shards`
(which slice of each checkpoint tensor a rank loads), `vocab` (the vocab-parallel embedding
and logits gather), `ranks` (the follower processes, how steps reach them, and how a dead rank
takes the group down). The models stay readable: they build their layers through
models/layer_impls.py, whose `with_tp` adds the all-reduces and the vocabulary split.
"""
