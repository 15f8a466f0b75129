#!/usr/bin/env bash
# One device call (issue #9): where whole decode steps go on the device at batch 1, 64 and
# 256 (bench/gpu/decode_e2e.py --trace-steps: plans launched one ahead as the mesh runs them;
# input copies, the step graph, LM head, sampling, token copy), traces kept in $OUT.
#
#   run(command="bash bench/gpu/step_trace_batches_session.sh", carry=[".whl", ".redisbin"])
source "$(dirname "$0")/session_env.sh"

step steps 400 python3 -m bench.gpu.decode_e2e --batches 1 64 256 --skip-hf \
    --max-model-len 1024 --trace-steps "$OUT/steps_trace.json" --out "$OUT/steps.json"
gzip -f "$OUT"/steps_trace_b*.json
echo "=== session done, $((DEADLINE - $(date +%s)))s before the deadline"
