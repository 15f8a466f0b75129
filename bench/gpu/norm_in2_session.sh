#!/usr/bin/env bash
# (The norm-in GEMV these calls measured was dropped and its code removed after them:
# bench/gpu/norm_in_h200.log, which names the commits that have it.)
# Second device call for kernels/gemv_norm_in.py (issue #9): its sum of squares reduced once
# after the K loop instead of every K-step (the first call, bench/gpu/norm_in_h200.log: the
# batch-1 step graph 9.56 ms against 3.89 without it). GPU tests, then the batch-1 step graph
# alternating off / on, with the qkv GEMV on 32- and 64-row tiles; the mesh only if it gains.
#
#   run(command="bash bench/gpu/norm_in2_session.sh", carry=[".whl", ".redisbin"])
source "$(dirname "$0")/session_env.sh"

step gpu-tests 120 python3 -m pytest -q -x tests/kernels/test_gemv_norm_in.py \
    tests/gpu/test_decode_chain_cuda.py tests/kernels/test_decode_chain.py
plain_copy
sed -i 's/^NORM_IN_DEFAULT = True/NORM_IN_DEFAULT = False/' \
    /tmp/plain/services/worker/decode_chain.py
rm -rf /tmp/q64 && cp -r . /tmp/q64
sed -i 's/(6144, 4096): GemvConfig(block_n=32,/(6144, 4096): GemvConfig(block_n=64,/' \
    /tmp/q64/kernels/gemv_norm_in.py
for round in 1 2; do
    (cd /tmp/plain && export PYTHONPATH=/tmp/site:/tmp/plain && b1_graph "off-$round")
    b1_graph "on-$round"
    (cd /tmp/q64 && export PYTHONPATH=/tmp/site:/tmp/q64 && b1_graph "on-q64-$round")
done
gains=$(b1_graph_faster on off)
echo "on faster than off: $gains"
if [ "$gains" = 1 ]; then mesh_ab "${ROUNDS:-2}" off on; fi
echo "=== session done, $((DEADLINE - $(date +%s)))s before the deadline"
