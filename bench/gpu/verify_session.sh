#!/usr/bin/env bash
# One device call: every GPU and kernel test on the H200 with the session's defaults (the PDL
# chain on), then the mesh at batch 1, 16 and 64 (prompt 512, output 128), twice.
#
#   run(command="bash bench/gpu/verify_session.sh", carry=[".whl", ".redisbin"])
source "$(dirname "$0")/session_env.sh"

step gpu-tests 330 python3 -m pytest -q tests/gpu tests/kernels tests/unit/worker/test_cuda_graphs.py
for round in 1 2; do
    step "mesh-$round" 100 python3 -m bench.gpu.mesh_decode --batches 1 16 64 \
        --out "$OUT/mesh_$round.json"
done
echo "=== session done, $((DEADLINE - $(date +%s)))s before the deadline"
