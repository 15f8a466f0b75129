#!/usr/bin/env bash
# Issue #9, tenth session, second glue call: glue_session.sh's changes plus the chain's first
# kernel doing the token feed, the embedding and the first RMSNorm in one launch
# (kernels/decode_chain/embed_rmsnorm.py) and the sampling launched PDL after the LM head; against the
# same base tree (base_tree.tar). Then the whole GPU suite with what time is left.
#
#   run(command="bash bench/gpu/glue2_session.sh", carry=[".whl", ".redisbin"])
SESSION_SECONDS=${SESSION_SECONDS:-585}
source "$(dirname "$0")/session_env.sh"
rm -rf /tmp/plain && mkdir -p /tmp/plain && tar -xf base_tree.tar -C /tmp/plain
step gpu-glue-tests 150 python3 -m pytest -q -x -p no:cacheprovider \
    tests/kernels/test_sampling_kernel.py tests/kernels/test_token_feed.py \
    tests/kernels/test_embed_rmsnorm.py tests/kernels/test_decode_chain.py \
    tests/gpu/test_overlap_cuda.py tests/gpu/test_no_host_sync_cuda.py \
    tests/gpu/test_decode_chain_cuda.py tests/unit/worker/test_cuda_graphs.py 2>&1 | tail -4
step steady-trace 60 python3 -m bench.gpu.chain_trace --steady 4 --trace /tmp/steady.json \
    --kernels > "$OUT/steady_trace.txt"
tail -14 "$OUT/steady_trace.txt"
grep -n -A10 "gemv LM head" "$OUT/steady_trace.txt" | sed -n 12,23p
mesh_ab 2 base glue
rm -f "$OUT"/mesh_*_2.json
step gpu-suite 400 python3 -m pytest -q -p no:cacheprovider tests/gpu tests/kernels \
    tests/unit/worker/test_cuda_graphs.py 2>&1 | tail -8
echo "=== session done, $((DEADLINE - $(date +%s)))s before the deadline"
