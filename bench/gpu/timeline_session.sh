#!/usr/bin/env bash
# One device call (issue #9, batch 256): the mesh at batch 64 and 256 with the worker's step
# timeline (services/worker/step_timeline.py), summarized by bench/step_timeline.py: where the
# GPU sits idle between steps, by cause and by the kind of step that follows.
#
#   run(command="bash bench/gpu/timeline_session.sh", carry=[".whl", ".redisbin"])
source "$(dirname "$0")/session_env.sh"

step mesh 150 python3 -m bench.gpu.mesh_decode --batches 64 256 --out "$OUT/mesh.json" \
    --timeline "$OUT/timeline.jsonl"
step timeline 20 python3 -m bench.step_timeline "$OUT/timeline.jsonl"
gzip -f "$OUT/timeline.jsonl"
echo "=== session done, $((DEADLINE - $(date +%s)))s before the deadline"
