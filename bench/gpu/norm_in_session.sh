#!/usr/bin/env bash
# (The norm-in GEMV these calls measured was dropped and its code removed after them:
# bench/gpu/norm_in_h200.log, which names the commits that have it.)
# One device call (issue #9, batch-1 decode): the qkv and gate_up GEMVs doing their RMSNorm
# themselves (kernels/gemv_norm_in.py; services/worker/accel/decode_chain.py NORM_IN_DEFAULT), so a
# batch-1 layer is 5 launches instead of 7. GPU tests of the kernel and the chain, the batch-1
# step graph alternating with a copy of this tree where it is off (and one round with the qkv
# GEMV on 64-row tiles, 96 programs, instead of 32-row ones), then the mesh at batch 1 and 16
# alternating off / on.
#
#   run(command="bash bench/gpu/norm_in_session.sh", carry=[".whl", ".redisbin"])
source "$(dirname "$0")/session_env.sh"

step gpu-tests 150 python3 -m pytest -q -x tests/kernels/test_gemv_norm_in.py \
    tests/gpu/test_decode_chain_cuda.py tests/kernels/test_decode_chain.py \
    tests/gpu/test_decode_from_qkv_cuda.py tests/kernels/test_gemv_add_rmsnorm.py
plain_copy
sed -i 's/^NORM_IN_DEFAULT = True/NORM_IN_DEFAULT = False/' \
    /tmp/plain/services/worker/decode_chain.py
grep -n "^NORM_IN_DEFAULT" /tmp/plain/services/worker/decode_chain.py
rm -rf /tmp/q64 && cp -r . /tmp/q64
sed -i 's/(6144, 4096): GemvConfig(block_n=32,/(6144, 4096): GemvConfig(block_n=64,/' \
    /tmp/q64/kernels/gemv_norm_in.py
grep -n "(6144, 4096)" /tmp/q64/kernels/gemv_norm_in.py
for round in 1 2; do
    (cd /tmp/plain && export PYTHONPATH=/tmp/site:/tmp/plain && b1_graph "off-$round")
    b1_graph "on-$round"
done
(cd /tmp/q64 && export PYTHONPATH=/tmp/site:/tmp/q64 && b1_graph "on-q64")
mesh_ab "${ROUNDS:-2}" off on
echo "=== session done, $((DEADLINE - $(date +%s)))s before the deadline"
