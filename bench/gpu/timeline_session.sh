#!/usr/bin/env bash
# One device call (issue #9): the mesh at batch 64 and 256 with the worker's step timeline
# (MESHLLM_STEP_TIMELINE via --timeline; bench/step_timeline.py: where the GPU idles between
# steps and why), at the committed code.
#
#   run(command="bash bench/gpu/timeline_session.sh", carry=[".whl", ".redisbin"])
SESSION_SECONDS=${SESSION_SECONDS:-300}
source "$(dirname "$0")/session_env.sh"

step mesh 150 python3 -m bench.gpu.mesh_decode --batches 64 256 --out "$OUT/mesh.json" \
    --timeline "$OUT/timeline.jsonl"
step timeline 30 python3 -m bench.step_timeline "$OUT/timeline.jsonl" --split-ms 200
gzip -f "$OUT"/timeline.jsonl
echo "=== session done, $((DEADLINE - $(date +%s)))s before the deadline"
