#!/usr/bin/env bash
# (The 17..64-row GEMV this call measured was removed after it: bench/gpu/skinny_gemm_h200.log.)
# One device call (issue #9): the Triton GEMV at 17..64 rows (kernels/decode_chain/gemv.py
# H200_WIDE_CONFIGS, services/worker/accel/cuda_layers.py GEMV_MAX_ROWS). Sweeps its tiles against
# cuBLAS at the Llama-3-8B shapes and writes the winners into this tree's gemv.py, runs the
# GEMV and decode-chain GPU tests with them, then the mesh at batch 24 and 64 for a copy that
# keeps cuBLAS above 16 rows (GEMV_MAX_ROWS = 16) and this tree, alternating.
#
#   run(command="bash bench/gpu/skinny_gemm_session.sh", carry=[".whl", ".redisbin"])
SESSION_SECONDS=${SESSION_SECONDS:-585}
source "$(dirname "$0")/session_env.sh"

plain_copy
sed -i 's/^GEMV_MAX_ROWS = .*/GEMV_MAX_ROWS = 16/' /tmp/plain/services/worker/cuda_layers.py
grep -n "^GEMV_MAX_ROWS" /tmp/plain/services/worker/cuda_layers.py
step sweep 280 python3 -m bench.gpu.skinny_gemm_sweep --apply --table "$OUT/wide_table.txt"
sed -n '/^H200_WIDE_CONFIGS/,/^}/p' kernels/decode_chain/gemv.py
step gpu-tests 100 python3 -m pytest -q -x tests/kernels/test_gemv.py \
    tests/kernels/test_gemv_add_rmsnorm.py tests/gpu/test_decode_chain_cuda.py
for round in ${ROUNDS_LIST:-1 2}; do
    (cd /tmp/plain && export PYTHONPATH=/tmp/site:/tmp/plain && step "mesh-cublas-$round" 60 \
        python3 -m bench.gpu.mesh_decode --batches 24 64 --out "$OUT/mesh_cublas_$round.json")
    step "mesh-gemv-$round" 60 python3 -m bench.gpu.mesh_decode --batches 24 64 \
        --out "$OUT/mesh_gemv_$round.json"
done
echo "=== session done, $((DEADLINE - $(date +%s)))s before the deadline"
