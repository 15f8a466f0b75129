#!/usr/bin/env bash
# One device call (issue #9): the mesh at batch 1, 16, 64 and 256 (prompt 512, output 128)
# for a copy of this tree whose kernels/ and services/ are those of .basetree (before the
# SiLU-and-multiply kernel and the fewer launches per decode step) and for this tree,
# alternating twice around transformers `generate` at 64 and 256 in the same call.
#
#   rm -rf .basetree && mkdir .basetree && git archive ea59703 kernels services | tar -x -C .basetree
#   run(command="bash bench/gpu/launches_mesh_session.sh", carry=[".whl", ".redisbin", ".basetree"])
SESSION_SECONDS=${SESSION_SECONDS:-580}
source "$(dirname "$0")/session_env.sh"

plain_copy
cp -r .basetree/kernels .basetree/services /tmp/plain/
grep -c "silu_mul" /tmp/plain/services/worker/cuda_layers.py  # 0: the base
base() {
    (cd /tmp/plain && export PYTHONPATH=/tmp/site:/tmp/plain && step "mesh-base-$1" 120 \
        python3 -m bench.gpu.mesh_decode --batches 1 16 64 256 --out "$OUT/mesh_base_$1.json")
}
new() {
    step "mesh-new-$1" 120 python3 -m bench.gpu.mesh_decode --batches 1 16 64 256 \
        --out "$OUT/mesh_new_$1.json"
}
base 1
new 1
step transformers 150 python3 -m bench.gpu.decode_e2e --batches --hf-batches 64 256 \
    --out "$OUT/transformers.json"
base 2
new 2
echo "=== session done, $((DEADLINE - $(date +%s)))s before the deadline"
