#!/usr/bin/env bash
# One device call (issue #9, batch-1 decode): the gated MLP's SiLU fused into the down
# projection's GEMV. GPU tests (worker path, GEMV, graphs), the kernel A/B
# (bench/gpu/gemv_fusions.py), then the mesh at batch 1 and 16 alternating with a copy of the same
# tree where install_cuda_kernels leaves GatedMLP alone (the previous, unfused path), twice.
#
#   run(command="bash bench/gpu/gated_mlp_session.sh", carry=[".whl", ".redisbin"])
source "$(dirname "$0")/session_env.sh"

step gpu-tests 200 python3 -m pytest -q tests/gpu tests/kernels/test_gemv.py \
    tests/unit/worker/test_cuda_graphs.py
step gated-gemv 60 python3 bench/gpu/gemv_fusions.py
rm -rf /tmp/baseline && mkdir -p /tmp/baseline && cp -r . /tmp/baseline/ 2>/dev/null
sed -i 's/        if type(module) is GatedMLP:/        if False:/' \
    /tmp/baseline/services/worker/cuda_layers.py
grep -n "if False" /tmp/baseline/services/worker/cuda_layers.py | head -3
for round in 1 2; do
    step "mesh-fused-$round" 100 python3 -m bench.gpu.mesh_decode --batches 1 16 \
        --out "$OUT/mesh_fused_$round.json"
    (cd /tmp/baseline && export PYTHONPATH=/tmp/site:/tmp/baseline && step "mesh-unfused-$round" \
        100 python3 -m bench.gpu.mesh_decode --batches 1 16 --out "$OUT/mesh_unfused_$round.json")
done
echo "=== session done, $((DEADLINE - $(date +%s)))s before the deadline"
