#!/usr/bin/env bash
# One device call (issue #9): why a batch-1 decode step takes longer in the mesh than in the
# worker alone. The mesh at batch 1 with the worker's step timeline (device spans and host
# marks of every step, kept in $OUT), twice; then the worker alone with plans launched one
# ahead, traced (bench/gpu/decode_e2e.py --trace-steps), for the device step it reaches.
#
#   run(command="bash bench/gpu/b1_mesh_timeline_session.sh", carry=[".whl", ".redisbin"])
SESSION_SECONDS=${SESSION_SECONDS:-400}
source "$(dirname "$0")/session_env.sh"

for round in 1 2; do
    step "mesh-$round" 60 python3 -m bench.gpu.mesh_decode --batches 1 \
        --out "$OUT/mesh_$round.json" --timeline "$OUT/timeline_$round.jsonl"
    step "timeline-$round" 20 python3 -m bench.step_timeline "$OUT/timeline_$round.jsonl"
done
step worker-trace 120 python3 -m bench.gpu.decode_e2e --batches 1 --skip-hf \
    --max-model-len 1024 --trace-steps "$OUT/steps_trace.json" --out "$OUT/worker.json"
gzip -f "$OUT"/steps_trace_b*.json
echo "=== session done, $((DEADLINE - $(date +%s)))s before the deadline"
