#!/usr/bin/env bash
# One device call (issue #9: paged decode attention at 32k >= 80% of HBM): the split-K pieces
# merged by the last piece to finish (kernels/paged_decode.py FUSED_REDUCE) vs a second kernel.
#
#   run(command="bash bench/gpu/decode_merge_session.sh", carry=[".whl", ".redisbin"])
source "$(dirname "$0")/session_env.sh"

step decode-timings 150 python3 bench/gpu/kernels_check.py --skip-checks --only hbm,decode \
    --out "$OUT/decode_merge.json"
step decode-checks 120 python3 bench/gpu/kernels_check.py --skip-timings --only decode \
    --out "$OUT/decode_checks.json"
step gpu-tests 200 python3 -m pytest -q tests/kernels/test_paged_decode.py tests/gpu \
    tests/unit/worker/test_cuda_graphs.py tests/kernels/test_worker_triton_path.py
echo "=== session done, $((DEADLINE - $(date +%s)))s before the deadline"
