#!/usr/bin/env bash
# One device call (issue #9): the single-pass decode kernel's many-programs tiles
# (kernels/attention/paged_decode.py single_pass_tiles): its GPU tests, the tile sweep at long contexts
# too, and the mesh at batch 64 and 256 for a copy with the choice off (MANY_PROGRAMS out of
# reach) and this tree.
#
#   run(command="bash bench/gpu/decode_tiles_session.sh", carry=[".whl", ".redisbin"])
SESSION_SECONDS=${SESSION_SECONDS:-300}
source "$(dirname "$0")/session_env.sh"

step gpu-tests 80 python3 -m pytest -q tests/gpu/test_paged_decode_batch_cuda.py \
    tests/kernels/test_paged_decode.py
step sweep 40 python3 bench/gpu/decode_batch_sweep.py --focus --repeats 5 \
    --cases 256x4096 64x4096 128x1024
plain_copy
sed -i 's/^MANY_PROGRAMS = 1024$/MANY_PROGRAMS = 1 << 40/' /tmp/plain/kernels/paged_decode.py
grep -n "^MANY_PROGRAMS" /tmp/plain/kernels/paged_decode.py
(cd /tmp/plain && export PYTHONPATH=/tmp/site:/tmp/plain && step mesh-off 70 python3 -m \
    bench.gpu.mesh_decode --batches 64 256 --out "$OUT/mesh_off.json")
step mesh-on 70 python3 -m bench.gpu.mesh_decode --batches 64 256 --out "$OUT/mesh_on.json"
echo "=== session done, $((DEADLINE - $(date +%s)))s before the deadline"
