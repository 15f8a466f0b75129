#!/usr/bin/env bash
# (The norms inside the decode GEMVs this call measured were dropped and removed after it:
# bench/gpu/norms_in_gemvs_h200.log names the commits that have them.)
# The decode chain with its norms inside the GEMVs (issue #9, batch 1): the o and down
# projections add themselves to the residual stream and leave per-tile sums of squares
# (kernels/decode_chain/gemv.py gemv_into_stream), the qkv and gate_up GEMVs apply the norm as they load
# the stream (gemv_normed): 5 launches a layer instead of 7. Its GPU tests, then the batch-1
# step graph and the mesh at batch 1 and 16 with it off (A: a copy of this tree with
# NORMS_IN_GEMVS_DEFAULT = False) and on (B), alternating.
#
#   run(command="bash bench/gpu/norms_in_gemvs_session.sh", carry=[".whl", ".redisbin"])
SESSION_SECONDS=${SESSION_SECONDS:-580}
source "$(dirname "$0")/session_env.sh"
step gpu-tests 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_gemv_stream.py \
    tests/kernels/test_gemv.py tests/kernels/test_gemv_add_rmsnorm.py \
    tests/kernels/test_decode_chain.py tests/gpu/test_decode_chain_cuda.py \
    tests/gpu/test_decode_from_qkv_cuda.py tests/gpu/test_pdl_chain_cuda.py
plain_copy
sed -i 's/^NORMS_IN_GEMVS_DEFAULT = True/NORMS_IN_GEMVS_DEFAULT = False/' \
    /tmp/plain/services/worker/decode_chain.py
grep -n "^NORMS_IN_GEMVS_DEFAULT" /tmp/plain/services/worker/decode_chain.py \
    services/worker/accel/decode_chain.py
for r in 1 2; do
    (cd /tmp/plain && export PYTHONPATH=/tmp/site:/tmp/plain && b1_graph "off-$r")
    b1_graph "on-$r"
done
mesh_ab ${MESH_ROUNDS:-1} off on
for f in "$OUT"/mesh_*.json; do
    python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[1].rsplit('/',1)[1], [(r['batch'], r['throughput_tok_s'], r['decode_tok_s_per_request_median'], r['tokens_sha256']) for r in d['runs']])" "$f"
done
echo "=== session done, $((DEADLINE - $(date +%s)))s before the deadline"
