#!/usr/bin/env bash
# Issue #9, tenth session: the final tree through the mesh at batch 1, 16, 64 and 256, twice
# around transformers `generate` at 64 and 256 in the same call (the README's ratios).
#
#   run(command="bash bench/gpu/glue_ratio_session.sh", carry=[".whl", ".redisbin"])
SESSION_SECONDS=${SESSION_SECONDS:-400}
source "$(dirname "$0")/session_env.sh"
step mesh-1 100 python3 -m bench.gpu.mesh_decode --batches 1 16 64 256 \
    --out "$OUT/mesh_1.json" | grep "^mesh"
step transformers 110 python3 -m bench.gpu.decode_e2e --batches --hf-batches 64 256 \
    --out "$OUT/transformers.json" | tail -12
step mesh-2 100 python3 -m bench.gpu.mesh_decode --batches 1 16 64 256 \
    --out "$OUT/mesh_2.json" | grep "^mesh"
echo "=== session done, $((DEADLINE - $(date +%s)))s before the deadline"
