#!/usr/bin/env bash
# One device call (issue #9): decode attention tile configs at batch 256 and 64, 576 keys
# (bench/gpu/decode_batch_sweep.py).
#
#   run(command="bash bench/gpu/decode_batch_session.sh", carry=[".whl", ".redisbin"])
SESSION_SECONDS=${SESSION_SECONDS:-280}
source "$(dirname "$0")/session_env.sh"

step sweep 260 python3 bench/gpu/decode_batch_sweep.py ${SWEEP_ARGS:-}
echo "=== session done, $((DEADLINE - $(date +%s)))s before the deadline"
