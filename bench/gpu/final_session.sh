#!/usr/bin/env bash
# One device call at the end of a session: every GPU and kernel test on the H200 with the
# defaults as committed (decode chain on), the mesh at batch 1, 16, 64 and 256 (prompt 512,
# output 128) twice around transformers `generate` at 64 and 256 in the same call; the second
# mesh run writes the worker's step timeline (where the GPU idles between steps,
# bench/step_timeline.py), and the batch-1 step graph is timed alone (bench/gpu/decode_e2e.py).
#
#   run(command="bash bench/gpu/final_session.sh", carry=[".whl", ".redisbin"])
source "$(dirname "$0")/session_env.sh"

step gpu-tests 330 python3 -m pytest -q tests/gpu tests/kernels tests/unit/worker/test_cuda_graphs.py
step mesh-1 120 python3 -m bench.gpu.mesh_decode --batches 1 16 64 256 --out "$OUT/mesh_1.json"
step transformers 150 python3 -m bench.gpu.decode_e2e --batches --hf-batches 64 256 \
    --out "$OUT/transformers.json"
step mesh-2 120 python3 -m bench.gpu.mesh_decode --batches 1 16 64 256 --out "$OUT/mesh_2.json" \
    --timeline "$OUT/timeline.jsonl"
step timeline 20 python3 -m bench.step_timeline "$OUT/timeline.jsonl"
step b1-graph 60 python3 -m bench.gpu.decode_e2e --batches 1 --skip-hf --max-model-len 1024 \
    --out "$OUT/b1_graph.json"
echo "=== session done, $((DEADLINE - $(date +%s)))s before the deadline"
