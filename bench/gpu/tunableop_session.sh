#!/usr/bin/env bash
# cuBLAS by default vs PyTorch's TunableOp at the 8B linears' decode (64, 256 rows) and prefill
# (8192 rows) shapes (issue #9, the batch-64/256 targets): bench/gpu/tunableop_gemm.py.
#
#   run(command="bash bench/gpu/tunableop_session.sh", carry=[".whl", ".redisbin"])
SESSION_SECONDS=${SESSION_SECONDS:-300}
source "$(dirname "$0")/session_env.sh"
step tunableop 280 python3 -m bench.gpu.tunableop_gemm ${ROWS:+--rows $ROWS}
echo "=== session done, $((DEADLINE - $(date +%s)))s before the deadline"
