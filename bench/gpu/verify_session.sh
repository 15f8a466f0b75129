#!/usr/bin/env bash
# One device call at the end of a session: every GPU and kernel test on the H200 at the
# committed code, one eager 8192-token prefill step against its matmuls alone
# (bench/gpu/prefill_step.py), and the batch-1 decode breakdown (bench/gpu/decode_e2e.py).
#
#   run(command="bash bench/gpu/verify_session.sh", carry=[".whl", ".redisbin"])
SESSION_SECONDS=${SESSION_SECONDS:-560}
source "$(dirname "$0")/session_env.sh"

step gpu-tests 330 python3 -m pytest -q tests/gpu tests/kernels tests/unit/worker/test_cuda_graphs.py
step prefill-step 90 python3 -m bench.gpu.prefill_step --out "$OUT/prefill_step.json"
step b1-graph 60 python3 -m bench.gpu.decode_e2e --batches 1 --skip-hf --max-model-len 1024 \
    --out "$OUT/b1_graph.json"
echo "=== session done, $((DEADLINE - $(date +%s)))s before the deadline"
