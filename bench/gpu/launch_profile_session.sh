#!/usr/bin/env bash
# One device call (issue #9): where launch() holds the host at batch 256
# (bench/gpu/launch_profile.py; LAUNCH_PROFILE_ARGS=--cprofile for the Python side by function).
#
#   run(command="bash bench/gpu/launch_profile_session.sh", carry=[".whl", ".redisbin"])
#   run(command="LAUNCH_PROFILE_ARGS=--cprofile bash bench/gpu/launch_profile_session.sh", ...)
SESSION_SECONDS=${SESSION_SECONDS:-300}
source "$(dirname "$0")/session_env.sh"
read -r -a PROFILE_ARGS <<< "${LAUNCH_PROFILE_ARGS:-}"
step launch-profile 240 python3 -m bench.gpu.launch_profile "${PROFILE_ARGS[@]}"
echo "=== session done, $((DEADLINE - $(date +%s)))s before the deadline"
