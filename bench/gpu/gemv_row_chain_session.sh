#!/usr/bin/env bash
# (This call ran at commit d0f8335: kernels/gemv_row.py and `gemv_chain_sweep --cores` were
# removed after it, bench/gpu/gemv_row_chain_h200.log.)
# The one-row CUDA-core GEMV's tiles swept inside the 32-layer decode chain (issue #9, batch 1;
# after it saved 6-7 us a launch in isolation but nothing in the step graph:
# bench/gpu/gemv_row_h200.log).
#
#   run(command="bash bench/gpu/gemv_row_chain_session.sh", carry=[".whl", ".redisbin"])
SESSION_SECONDS=${SESSION_SECONDS:-300}
source "$(dirname "$0")/session_env.sh"
step chain-sweep 280 python3 -m bench.gpu.gemv_chain_sweep --cores --rows 1 --replays 9
