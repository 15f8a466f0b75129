#!/usr/bin/env bash
# (The kernel and bench/gpu/gemv_mma_bench.py this call ran were removed after it; they are in
# commit 9b3385b. Results: bench/gpu/gemv_mma_h200.log.)
# Issue #9, eleventh session: the 2..16-row decode chain with each product on the warpgroup-MMA
# kernel (qkv / o / down at 8 splits, partials consumed by the next kernel) or not, and gate_up
# on cuBLAS instead of the tensor-core GEMV (cuBLAS streamed it fastest in the shape sweep).
#
#   run(command="bash bench/gpu/gemv_mma_variants_session.sh", carry=[".whl", ".redisbin"])
SESSION_SECONDS=${SESSION_SECONDS:-300}
source "$(dirname "$0")/session_env.sh"
for round in 1 2; do
    step "variants-$round" 120 python3 -m bench.gpu.gemv_mma_bench variants --rows 2 8 16
done
echo "=== session done, $((DEADLINE - $(date +%s)))s before the deadline"
