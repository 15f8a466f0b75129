#!/usr/bin/env bash
# Issue #9, tenth session, first call: the whole GPU suite on the tree as committed (the ninth
# session's final tree never ran on the device), the mesh at batch 1 and 16, and four
# consecutive batch-1 decode steps traced as the worker launches them (overlapped, fed on the
# device), so the glue between two steps' graphs shows: sampling, copies, the token feed.
#
#   run(command="bash bench/gpu/steady_trace_session.sh", carry=[".whl", ".redisbin"])
SESSION_SECONDS=${SESSION_SECONDS:-540}
source "$(dirname "$0")/session_env.sh"
step gpu-suite 240 python3 -m pytest -q -x -p no:cacheprovider tests/gpu tests/kernels \
    tests/unit/worker/test_cuda_graphs.py 2>&1 | tail -15
step steady-trace 120 python3 -m bench.gpu.chain_trace --steady 4 --trace /tmp/steady.json \
    --kernels > "$OUT/steady_trace.txt"
tail -25 "$OUT/steady_trace.txt"
step mesh 100 python3 -m bench.gpu.mesh_decode --batches 1 16 --out "$OUT/mesh.json"
echo "=== session done, $((DEADLINE - $(date +%s)))s before the deadline"
