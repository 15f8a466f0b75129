#!/usr/bin/env bash
# One device call (issue #9): the mesh at batch 1 and 16 with two and three plans out at once
# (MESHLLM_SCHEDULE_AHEAD), alternating, two rounds: does three ahead cost the small batches?
#
#   run(command="bash bench/gpu/ahead_session.sh", carry=[".whl", ".redisbin"])
source "$(dirname "$0")/session_env.sh"

for round in 1 2; do
    for ahead in 2 3; do
        step "mesh-ahead$ahead-$round" 60 python3 -m bench.gpu.mesh_decode --batches 1 16 \
            --schedule-ahead "$ahead" --out "$OUT/mesh_ahead${ahead}_$round.json" | grep "^mesh"
    done
done
echo "=== session done, $((DEADLINE - $(date +%s)))s before the deadline"
