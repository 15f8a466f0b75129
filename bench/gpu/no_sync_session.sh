#!/usr/bin/env bash
# One device call (issue #9): launching a step no longer waits for the GPU (sampling state
# written through services/worker/sampling/row_params.py, staged row-token lists, no boolean
# compaction). GPU tests of the change, then the mesh at batch 64 and 256 for the tree before
# it (.basetree: `git archive` of services, kernels and shared at the base commit, carried) and
# this tree, alternating: once plain, once with the worker's step timeline (bench/step_timeline.py
# splits the device's idle time between steps by cause: host prep / late plan).
#
#   run(command="bash bench/gpu/no_sync_session.sh", carry=[".whl", ".redisbin", ".basetree"])
SESSION_SECONDS=${SESSION_SECONDS:-560}
source "$(dirname "$0")/session_env.sh"

step gpu-tests 120 python3 -m pytest -q tests/gpu/test_no_host_sync_cuda.py \
    tests/gpu/test_overlap_cuda.py tests/kernels/test_sampling_kernel.py \
    -p no:cacheprovider
plain_copy
rm -rf /tmp/plain/services /tmp/plain/kernels /tmp/plain/shared
cp -r .basetree/services .basetree/kernels .basetree/shared /tmp/plain/
ls /tmp/plain/services/worker/sampling/
mesh() {  # mesh NAME [ARGS]: the mesh at batch 64 and 256 from the current directory's tree
    local name=$1
    shift
    step "mesh-$name" 80 python3 -m bench.gpu.mesh_decode --batches 64 256 \
        --out "$OUT/mesh_$name.json" "$@"
}
(cd /tmp/plain && export PYTHONPATH=/tmp/site:/tmp/plain && mesh base-1)
mesh nosync-1
(cd /tmp/plain && export PYTHONPATH=/tmp/site:/tmp/plain && mesh base-tl \
    --timeline "$OUT/timeline_base.jsonl")
mesh nosync-tl --timeline "$OUT/timeline_nosync.jsonl"
step timeline-base 20 python3 -m bench.step_timeline "$OUT/timeline_base.jsonl" --split-ms 200
step timeline-nosync 20 python3 -m bench.step_timeline "$OUT/timeline_nosync.jsonl" --split-ms 200
gzip -f "$OUT"/timeline_*.jsonl
echo "=== session done, $((DEADLINE - $(date +%s)))s before the deadline"
