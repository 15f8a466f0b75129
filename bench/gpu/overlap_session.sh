#!/usr/bin/env bash
# One device call (issue #9: the mesh's cost per step): overlapped worker steps on the H200.
#
#   run(command="bash bench/gpu/overlap_session.sh", carry=[".whl", ".redisbin"])
#
# The GPU test of the overlap (tokens equal step by step, graphs and eager steps), the mesh at
# batch 1/16/64/256 with MESHLLM_OVERLAP_STEPS on and off (asynchronous scheduling on in both;
# equal tokens_sha256 = identical greedy outputs), transformers `generate` at batch 1/64/256 in
# the same session, the 32k decode-attention timings and tile sweep, and the GPU tests.
source "$(dirname "$0")/session_env.sh"

step overlap-test 90 python3 -m pytest -q -s tests/gpu/test_overlap_cuda.py
step mesh-overlap-on 170 python3 -m bench.gpu.mesh_decode --overlap on \
    --batches 1 16 64 256 --out "$OUT/mesh_overlap_on.json"
step mesh-overlap-off 170 python3 -m bench.gpu.mesh_decode --overlap off \
    --batches 1 16 64 256 --out "$OUT/mesh_overlap_off.json"
step transformers 200 python3 -m bench.gpu.decode_e2e --batches --hf-batches 1 64 256 \
    --out "$OUT/transformers.json"
step decode-sweep 200 python3 bench/gpu/kernels_check.py --skip-checks --only hbm,decode \
    --out "$OUT/decode_sweep.json"
step gpu-tests 150 python3 -m pytest -q tests/gpu tests/kernels/test_paged_decode.py \
    tests/unit/worker/test_cuda_graphs.py
echo "=== session done, $((DEADLINE - $(date +%s)))s before the deadline"
