#!/usr/bin/env bash
# One device call: every kernel test on the H200 after the attention tile step was shared
# between the prefill kernel and both decode kernels (attend_tile -> attend_tile_ids), then the
# decode A/B of bench/gpu/decode_variants.py (no sweep) and the prefill/extend timings of
# kernels_check.py, so the refactor is shown to change neither results nor speed.
#
#   run(command="bash bench/gpu/kernel_refactor_session.sh", carry=[".whl", ".redisbin"])
source "$(dirname "$0")/session_env.sh"

step kernel-tests 240 python3 -m pytest -q -x tests/kernels
step decode-variants 120 python3 bench/gpu/decode_variants.py --no-sweep \
    --out "$OUT/decode_variants.json"
step prefill-timings 120 python3 bench/gpu/kernels_check.py --skip-checks --only hbm,prefill \
    --out "$OUT/prefill_timings.json"
echo "=== session done, $((DEADLINE - $(date +%s)))s before the deadline"
