#!/usr/bin/env bash
# Deeper one-wave GEMV pipelines swept inside the 32-layer decode chain at 1 and 16 rows
# (issue #9, batch 1: the one-kernel-at-a-time profile, bench/gpu/b1_ncu_h200.log, has the
# qkv, o and down GEMVs at 3.3, 2.9 and 3.7 TB/s against 4.05 for gate_up and 4.43 for the LM
# head; bench/gpu/gemv_chain_sweep.py --deep).
#
#   run(command="bash bench/gpu/gemv_deep_session.sh", carry=[".whl", ".redisbin"])
SESSION_SECONDS=${SESSION_SECONDS:-420}
source "$(dirname "$0")/session_env.sh"
step deep-rows1 200 python3 -m bench.gpu.gemv_chain_sweep --deep --rows 1 --replays 9
step deep-rows16 180 python3 -m bench.gpu.gemv_chain_sweep --deep --rows 16 --replays 7
echo "=== session done, $((DEADLINE - $(date +%s)))s before the deadline"
