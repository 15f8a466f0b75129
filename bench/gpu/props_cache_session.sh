#!/usr/bin/env bash
# One short device call (issue #9): the cached device-property lookups (kernels/runtime/tensor_checks.py
# sm_count, supports_pdl) under the GPU tests of their callers, then launch() host time by
# function at batch 256 (bench/gpu/launch_profile.py --cprofile).
#
#   run(command="bash bench/gpu/props_cache_session.sh", carry=[".whl", ".redisbin"])
SESSION_SECONDS=${SESSION_SECONDS:-260}
source "$(dirname "$0")/session_env.sh"
step gpu-tests 110 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_pdl_chain_cuda.py \
    tests/gpu/test_decode_chain_cuda.py tests/gpu/test_paged_decode_batch_cuda.py \
    tests/kernels/test_gemv.py tests/gpu/test_no_host_sync_cuda.py
step launch-profile 100 python3 -m bench.gpu.launch_profile --cprofile
echo "=== session done, $((DEADLINE - $(date +%s)))s before the deadline"
