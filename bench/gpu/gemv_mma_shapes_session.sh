#!/usr/bin/env bash
# (The kernel and bench/gpu/gemv_mma_bench.py this call ran were removed after it; they are in
# commit 9b3385b. Results: bench/gpu/gemv_mma_h200.log.)
# Issue #9, eleventh session: the warpgroup-MMA skinny product (kernels/gemv_ws_mma.py) shape by
# shape, 32 launches with their own weights in a graph: cuBLAS, the tensor-core GEMV and the
# MMA kernel at splits 1/2/4/8 (with and without its reduce), at 2, 16, 32 and 64 rows.
#
#   run(command="bash bench/gpu/gemv_mma_shapes_session.sh", carry=[".whl", ".redisbin"])
SESSION_SECONDS=${SESSION_SECONDS:-300}
source "$(dirname "$0")/session_env.sh"
step shapes 240 python3 -m bench.gpu.gemv_mma_bench shapes --rows 2 16 32 64 --replays 7
echo "=== session done, $((DEADLINE - $(date +%s)))s before the deadline"
