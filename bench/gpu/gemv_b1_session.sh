#!/usr/bin/env bash
# One-row GEMV variants (tensor-core dot as shipped, CUDA-core, TMA-fed dot) at the Llama-3-8B
# layer shapes (issue #9, the batch-1 target: bench/gpu/gemv_b1_variants.py).
#
#   run(command="bash bench/gpu/gemv_b1_session.sh", carry=[".whl", ".redisbin"])
SESSION_SECONDS=${SESSION_SECONDS:-420}
source "$(dirname "$0")/session_env.sh"
step variants 400 python3 -m bench.gpu.gemv_b1_variants
