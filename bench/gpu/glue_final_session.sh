#!/usr/bin/env bash
# Issue #9, tenth session, last call: the final tree against the session's base tree
# (base_tree.tar = d9da526, untracked, travels along) through the mesh at batch 1, 16, 64 and
# 256, alternating, twice: the glue changes touch every batch size's sampling and copies.
#
#   run(command="bash bench/gpu/glue_final_session.sh", carry=[".whl", ".redisbin"])
SESSION_SECONDS=${SESSION_SECONDS:-560}
source "$(dirname "$0")/session_env.sh"
rm -rf /tmp/plain && mkdir -p /tmp/plain && tar -xf base_tree.tar -C /tmp/plain
mesh() {  # mesh NAME TREE ROUND
    (cd "$2" && export PYTHONPATH=/tmp/site:$2 && step "mesh-$1-$3" 120 python3 -m \
        bench.gpu.mesh_decode --batches 1 16 64 256 --out "$OUT/mesh_$1_$3.json" | grep "^mesh")
}
for round in 1 2; do
    mesh base /tmp/plain "$round"
    mesh final "$PWD" "$round"
done
echo "=== session done, $((DEADLINE - $(date +%s)))s before the deadline"
