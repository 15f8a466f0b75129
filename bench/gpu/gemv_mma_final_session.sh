#!/usr/bin/env bash
# (The kernel and bench/gpu/gemv_mma_bench.py this call ran were removed after it; they are in
# commit 03c8f0f. Results: bench/gpu/gemv_mma_h200.log.)
# Issue #9, eleventh session: the warpgroup-MMA skinny product at the sweep's best splits
# (fewest: their fp32 partials and reduce cost more than the balance they buy), against the
# tensor-core GEMV in the decode chain (2..16 rows) and cuBLAS (16..64 rows), twice.
#
#   run(command="bash bench/gpu/gemv_mma_final_session.sh", carry=[".whl", ".redisbin"])
SESSION_SECONDS=${SESSION_SECONDS:-300}
source "$(dirname "$0")/session_env.sh"
step check 120 python3 -m bench.gpu.gemv_mma_bench check > "$OUT/check.txt"
echo "checks ok: $(grep -c ' ok$' "$OUT/check.txt"), failed: $(grep -c FAIL "$OUT/check.txt")"
for round in 1 2; do
    step "chain-$round" 90 python3 -m bench.gpu.gemv_mma_bench chain --rows 2 8 16
    step "products-$round" 90 python3 -m bench.gpu.gemv_mma_bench products --rows 16 32 64
done
echo "=== session done, $((DEADLINE - $(date +%s)))s before the deadline"
