#!/usr/bin/env bash
# (The norm-in GEMV these calls measured was dropped and its code removed after them:
# bench/gpu/norm_in_h200.log, which names the commits that have it.)
# The norm-in GEMV alone against the plain GEMV at the same tiles (issue #9; after the step
# graph came out 2.4x slower with it, bench/gpu/norm_in_h200.log).
#
#   run(command="bash bench/gpu/norm_in_sweep_session.sh", carry=[".whl", ".redisbin"])
SESSION_SECONDS=${SESSION_SECONDS:-300}
source "$(dirname "$0")/session_env.sh"
step sweep 240 python3 -m bench.gpu.norm_in_sweep
