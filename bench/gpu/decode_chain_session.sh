#!/usr/bin/env bash
# One device call (issue #9, batch-1 decode): the decode chain (services/worker/accel/decode_chain.py,
# the o/down split-K reduces fused into the residual add + RMSNorm). GPU tests of the chain and
# its kernel, the chain in one graph (bench/gpu/pdl_chain.py, mode "fused"), a kernel trace of
# the batch-1 step (per-kernel time and the gaps between kernels), then the mesh at batch 1 and
# 16 alternating between a copy of this tree with the chain off and this tree.
#
#   run(command="bash bench/gpu/decode_chain_session.sh", carry=[".whl", ".redisbin"])
source "$(dirname "$0")/session_env.sh"

step gpu-tests 200 python3 -m pytest -q -x tests/gpu/test_decode_chain_cuda.py \
    tests/kernels/test_gemv_add_rmsnorm.py tests/kernels/test_decode_chain.py \
    tests/kernels/test_rmsnorm.py tests/kernels/test_gemv.py tests/gpu/test_worker_cuda.py
step pdl-chain 90 python3 bench/gpu/pdl_chain.py
step b1-trace 150 python3 -m bench.worker_step --device cuda --random llama3-8b --batch 1 \
    --prompt-len 512 --steps 32 --dtype bfloat16 --profile --trace "$OUT/b1_trace.json"
plain_copy
sed -i 's/^DECODE_CHAIN_DEFAULT = True/DECODE_CHAIN_DEFAULT = False/' \
    /tmp/plain/services/worker/decode_chain.py
grep -n "^DECODE_CHAIN_DEFAULT" /tmp/plain/services/worker/decode_chain.py
mesh_ab "${ROUNDS:-2}" plain chain
rm -f "$OUT/b1_trace.json"
echo "=== session done, $((DEADLINE - $(date +%s)))s before the deadline"
