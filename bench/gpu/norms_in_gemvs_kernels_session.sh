#!/usr/bin/env bash
# (The norms inside the decode GEMVs this call measured were dropped and removed after it:
# bench/gpu/norms_in_gemvs_h200.log names the commits that have them.)
# Second call on the norms inside the decode GEMVs (issue #9): the first
# (norms_in_gemvs_session.sh) found the batch-1 step graph slower with them (4.26 vs 3.89 ms).
# Its GPU tests again (one test fixed, a longer limit), then each site alone
# (bench/gpu/norms_in_gemvs_kernels.py) to see which side loses.
#
#   run(command="bash bench/gpu/norms_in_gemvs_kernels_session.sh", carry=[".whl", ".redisbin"])
SESSION_SECONDS=${SESSION_SECONDS:-420}
source "$(dirname "$0")/session_env.sh"
step gpu-tests 240 python3 -m pytest -q -p no:cacheprovider -x tests/kernels/test_gemv_stream.py \
    tests/kernels/test_decode_chain.py tests/gpu/test_decode_chain_cuda.py
step sites 120 python3 -m bench.gpu.norms_in_gemvs_kernels
echo "=== session done, $((DEADLINE - $(date +%s)))s before the deadline"
