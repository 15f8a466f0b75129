#!/usr/bin/env bash
# One device call (issue #9, batch-1 decode): the decode chain (services/worker/decode_chain.py,
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
rm -rf /tmp/plain && mkdir -p /tmp/plain && cp -r . /tmp/plain/ 2>/dev/null
sed -i 's/^DECODE_CHAIN_DEFAULT = True/DECODE_CHAIN_DEFAULT = False/' \
    /tmp/plain/services/worker/decode_chain.py
grep -n "^DECODE_CHAIN_DEFAULT" /tmp/plain/services/worker/decode_chain.py
for round in $(seq 1 ${ROUNDS:-2}); do
    (cd /tmp/plain && export PYTHONPATH=/tmp/site:/tmp/plain && step "mesh-plain-$round" \
        100 python3 -m bench.gpu.mesh_decode --batches 1 16 --out "$OUT/mesh_plain_$round.json")
    step "mesh-chain-$round" 100 python3 -m bench.gpu.mesh_decode --batches 1 16 \
        --out "$OUT/mesh_chain_$round.json"
done
rm -f "$OUT/b1_trace.json"
echo "=== session done, $((DEADLINE - $(date +%s)))s before the deadline"
