#!/usr/bin/env bash
# (The kernel and bench/gpu/gemv_mma_bench.py this call ran were removed after it; they are in
# commit 03c8f0f. Results: bench/gpu/gemv_mma_h200.log.)
# Issue #9, eleventh session: the warpgroup-MMA skinny product (kernels/gemv_ws_mma.py) on the
# H200: its numbers, its GPU tests, then its speed in 32-layer chains against the tensor-core
# GEMV (2..16 rows) and cuBLAS (16..64 rows), and a sweep of its splits and ring depths.
#
#   run(command="bash bench/gpu/gemv_mma_session.sh", carry=[".whl", ".redisbin"])
SESSION_SECONDS=${SESSION_SECONDS:-560}
source "$(dirname "$0")/session_env.sh"
step check 120 python3 -m bench.gpu.gemv_mma_bench check > "$OUT/check.txt"
echo "checks ok: $(grep -c ' ok$' "$OUT/check.txt"), failed: $(grep -c FAIL "$OUT/check.txt")"
grep FAIL "$OUT/check.txt"
step gpu-tests 150 python3 -m pytest -q -x tests/gpu/test_gemv_ws_cuda.py \
    tests/gpu/test_decode_chain_cuda.py tests/gpu/test_pdl_chain_cuda.py
step chain 90 python3 -m bench.gpu.gemv_mma_bench chain --rows 2 4 8 16
step products 90 python3 -m bench.gpu.gemv_mma_bench products --rows 16 32 64
step sweep 150 python3 -m bench.gpu.gemv_mma_bench sweep --rows 16 64 --replays 7
echo "=== session done, $((DEADLINE - $(date +%s)))s before the deadline"
