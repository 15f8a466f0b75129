#!/usr/bin/env bash
# One short device call (issue #9): does ModelRunner.launch synchronize with the GPU?
# (tests/gpu/test_no_host_sync_cuda.py lists each synchronizing call's file:line.)
#
#   run(command="bash bench/gpu/sync_probe_session.sh", carry=[".whl", ".redisbin"])
SESSION_SECONDS=${SESSION_SECONDS:-200}
source "$(dirname "$0")/session_env.sh"
step sync-test 150 python3 -m pytest -q tests/gpu/test_no_host_sync_cuda.py -p no:cacheprovider
echo "=== session done, $((DEADLINE - $(date +%s)))s before the deadline"
