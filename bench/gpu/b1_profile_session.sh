#!/usr/bin/env bash
# One device call (issue #9, batch-1 decode): where a batch-1 decode step's device time goes,
# kernel by kernel (eager kernels under the torch profiler), Llama-3-8B shape, prompt 512.
#
#   run(command="bash bench/gpu/b1_profile_session.sh", carry=[".whl", ".redisbin"])
source "$(dirname "$0")/session_env.sh"

step b1-profile 240 python3 -m bench.worker_step --device cuda --random llama3-8b \
    --batch 1 --prompt-len 512 --steps 32 --dtype bfloat16 --profile
echo "=== session done, $((DEADLINE - $(date +%s)))s before the deadline"
