#!/usr/bin/env bash
# Issue #9, eleventh session: the serving tree (unchanged since 2dd5a57) through the mesh at
# batch 1: two mesh processes of two runs each, to see where the 250 tok/s target stands in one
# more call.
#
#   run(command="bash bench/gpu/b1_confirm_session.sh", carry=[".whl", ".redisbin"])
SESSION_SECONDS=${SESSION_SECONDS:-300}
source "$(dirname "$0")/session_env.sh"
for round in 1 2; do
    step "mesh-b1-$round" 120 python3 -m bench.gpu.mesh_decode --batches 1 1 \
        --out "$OUT/mesh_b1_$round.json" | grep "^mesh"
done
echo "=== session done, $((DEADLINE - $(date +%s)))s before the deadline"
