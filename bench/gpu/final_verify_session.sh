#!/usr/bin/env bash
# One device call at the end of a session (issue #9): every GPU and kernel test on the H200 at
# the committed code, then the mesh at batch 64 and 256 twice around transformers `generate`
# at 64 and 256 in the same call (the throughput ratios of README.md).
#
#   run(command="bash bench/gpu/final_verify_session.sh", carry=[".whl", ".redisbin"])
SESSION_SECONDS=${SESSION_SECONDS:-585}
source "$(dirname "$0")/session_env.sh"

step gpu-tests 340 python3 -m pytest -q tests/gpu tests/kernels \
    tests/unit/worker/test_cuda_graphs.py -p no:cacheprovider
step mesh-1 75 python3 -m bench.gpu.mesh_decode --batches 64 256 --out "$OUT/mesh_1.json"
step transformers 110 python3 -m bench.gpu.decode_e2e --batches --hf-batches 64 256 \
    --out "$OUT/transformers.json"
step mesh-2 75 python3 -m bench.gpu.mesh_decode --batches 64 256 --out "$OUT/mesh_2.json"
echo "=== session done, $((DEADLINE - $(date +%s)))s before the deadline"
