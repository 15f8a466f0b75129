#!/usr/bin/env bash
# One device call (issue #9, batch-1 decode): GPU tests of the decode chain, then the GEMV tile
# configs swept inside the 32-layer fused chain at 1 and 16 rows (bench/gpu/gemv_chain_sweep.py).
#
#   run(command="bash bench/gpu/gemv_sweep_session.sh", carry=[".whl", ".redisbin"])
source "$(dirname "$0")/session_env.sh"

step gpu-tests 150 python3 -m pytest -q -x tests/gpu/test_decode_chain_cuda.py \
    tests/kernels/test_gemv_add_rmsnorm.py tests/kernels/test_decode_chain.py
step sweep-1 220 python3 bench/gpu/gemv_chain_sweep.py --rows 1
step sweep-16 150 python3 bench/gpu/gemv_chain_sweep.py --rows 16 --shapes gate_up qkv
echo "=== session done, $((DEADLINE - $(date +%s)))s before the deadline"
