#!/usr/bin/env bash
# Issue #9, tenth session: the glue between two batch-1 decode steps' graphs. The sampling in
# one launch (the Gumbel kernel gathers the rows' temperature and seed, merges its chunks and
# writes the token into the feed table), the fed token read inside the graph
# (kernels/decode_chain/token_feed.py), the uploads and the token download on their own streams, and the
# RoPE rows read by position in the fused attention (no per-step lookup): against the base
# tree (base_tree.tar, `git archive <base> -o base_tree.tar`, untracked, travels along).
#
#   run(command="bash bench/gpu/glue_session.sh", carry=[".whl", ".redisbin"])
SESSION_SECONDS=${SESSION_SECONDS:-560}
source "$(dirname "$0")/session_env.sh"
rm -rf /tmp/plain && mkdir -p /tmp/plain && tar -xf base_tree.tar -C /tmp/plain
cp bench/gpu/chain_trace.py bench/gpu/b1_step_kernels.py /tmp/plain/bench/gpu/
step gpu-tests 170 python3 -m pytest -q -x -p no:cacheprovider tests/gpu/test_overlap_cuda.py \
    tests/gpu/test_no_host_sync_cuda.py tests/gpu/test_worker_cuda.py \
    tests/gpu/test_decode_chain_cuda.py tests/unit/worker/test_cuda_graphs.py \
    tests/kernels/test_sampling_kernel.py tests/kernels/test_token_feed.py \
    tests/kernels/test_decode_chain.py 2>&1 | tail -6
step steady-trace 60 python3 -m bench.gpu.chain_trace --steady 4 --trace /tmp/steady.json \
    --kernels > "$OUT/steady_trace.txt"
tail -22 "$OUT/steady_trace.txt"
grep -n -A14 "gemv LM head" "$OUT/steady_trace.txt" | sed -n 16,32p
mesh_ab 2 base glue
echo "=== session done, $((DEADLINE - $(date +%s)))s before the deadline"
