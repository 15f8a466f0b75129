#!/usr/bin/env bash
# (The BLOCKING_WAIT knob this call measured was removed after it: bench/gpu/blocking_wait_h200.log.)
# One device call (issue #9, the batch-256 prefill launch that is slower in the mesh than in
# the worker alone): the worker's wait for a step's sampled tokens, which runs in a thread of
# its own while the step thread launches the next plan, spinning in the CUDA driver (default
# event, "spin") vs sleeping until the device signals (services/worker/runner/in_flight.py
# BLOCKING_WAIT, "block"). The mesh at batch 1 and 256, alternating.
#
#   run(command="bash bench/gpu/blocking_wait_session.sh", carry=[".whl", ".redisbin"])
SESSION_SECONDS=${SESSION_SECONDS:-265}
source "$(dirname "$0")/session_env.sh"
plain_copy
sed -i 's/^BLOCKING_WAIT = False/BLOCKING_WAIT = True/' /tmp/plain/services/worker/in_flight.py
grep -n "^BLOCKING_WAIT" /tmp/plain/services/worker/in_flight.py
for round in 1 2; do
    step "mesh-spin-$round" 60 python3 -m bench.gpu.mesh_decode --batches 1 256 \
        --out "$OUT/mesh_spin_$round.json"
    (cd /tmp/plain && export PYTHONPATH=/tmp/site:/tmp/plain && step "mesh-block-$round" 60 \
        python3 -m bench.gpu.mesh_decode --batches 1 256 --out "$OUT/mesh_block_$round.json")
done
echo "=== session done, $((DEADLINE - $(date +%s)))s before the deadline"
