#!/usr/bin/env bash
# One device call (issue #9, 32k decode attention): the decode tile/split sweep with
# programmatic dependent launch of the split-K merge off vs on, the decode kernel tests on the
# H200 (PDL included), and where a batch-64 decode step's device time goes, kernel by kernel.
#
#   run(command="bash bench/gpu/pdl_session.sh", carry=[".whl", ".redisbin"])
source "$(dirname "$0")/session_env.sh"

step decode-sweep 300 python3 bench/gpu/kernels_check.py --skip-checks --only hbm,decode \
    --out "$OUT/decode_pdl_sweep.json"
step decode-tests 120 python3 -m pytest -q tests/kernels/test_paged_decode.py \
    tests/kernels/test_worker_triton_path.py
step b64-profile 120 python3 -m bench.worker_step --device cuda --random llama3-8b \
    --batch 64 --prompt-len 512 --steps 16 --dtype bfloat16 --profile
echo "=== session done, $((DEADLINE - $(date +%s)))s before the deadline"
