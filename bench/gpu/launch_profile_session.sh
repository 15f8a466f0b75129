#!/usr/bin/env bash
# One device call (issue #9): where launch() holds the host at batch 256
# (bench/gpu/launch_profile.py).
#
#   run(command="bash bench/gpu/launch_profile_session.sh", carry=[".whl", ".redisbin"])
SESSION_SECONDS=${SESSION_SECONDS:-300}
source "$(dirname "$0")/session_env.sh"
step launch-profile 240 python3 -m bench.gpu.launch_profile
echo "=== session done, $((DEADLINE - $(date +%s)))s before the deadline"
