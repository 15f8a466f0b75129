#!/usr/bin/env bash
# One device call (issue: 32k batch-1 decode attention >= 80% of HBM): the decode kernel tests on
# the H200 (the strided kernel and its fused merge included), then
# bench/gpu/decode_variants.py: read ceiling and floors, a batch-1 32k sweep of strided-kernel
# configs, and old vs new at b1/b2/b4/b8 32k, b64 4k and fp8 b1 32k in alternating order.
# DECODE_VARIANTS_ARGS passes options through (e.g. "--no-sweep --extra 1,128,4,3,16");
# TESTS=full adds the worker's Triton-path tests.
#
#   run(command="SESSION_SECONDS=300 bash bench/gpu/decode_variants_session.sh",
#       carry=[".whl", ".redisbin"], timeout_s=400)
source "$(dirname "$0")/session_env.sh"

tests=(tests/kernels/test_paged_decode.py)
if [ "${TESTS:-}" = full ]; then
    tests+=(tests/kernels/test_worker_triton_path.py)
fi
step decode-tests 150 python3 -m pytest -q "${tests[@]}"
# shellcheck disable=SC2086
step decode-variants 420 python3 bench/gpu/decode_variants.py --out "$OUT/decode_variants.json" \
    ${DECODE_VARIANTS_ARGS:-}
echo "=== session done, $((DEADLINE - $(date +%s)))s before the deadline"
