#!/usr/bin/env bash
# (The one-row CUDA-core GEMV this call measured, kernels/gemv_row.py, was dropped and removed
# after it: bench/gpu/gemv_row_h200.log names the commit that has it.)
# The one-row CUDA-core GEMV (kernels/gemv_row.py) in the decode step (issue #9, batch 1):
# its GPU tests, the batch-1 step graph and the mesh at batch 1 and 16 with it off (A: a copy
# of this tree with ROW_GEMV_DEFAULT = False) and on (B), alternating; then a finer sweep of
# its tiles at the qkv, gate_up and LM head shapes.
#
#   run(command="bash bench/gpu/gemv_row_session.sh", carry=[".whl", ".redisbin"])
SESSION_SECONDS=${SESSION_SECONDS:-590}
source "$(dirname "$0")/session_env.sh"
step gpu-tests 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_gemv_row.py \
    tests/kernels/test_gemv.py tests/kernels/test_gemv_add_rmsnorm.py \
    tests/kernels/test_decode_chain.py tests/kernels/test_decode_from_qkv.py \
    tests/gpu/test_decode_chain_cuda.py tests/gpu/test_decode_from_qkv_cuda.py \
    tests/gpu/test_pdl_chain_cuda.py
plain_copy
sed -i 's/^ROW_GEMV_DEFAULT = True/ROW_GEMV_DEFAULT = False/' /tmp/plain/kernels/gemv_row.py
grep -n "^ROW_GEMV_DEFAULT" /tmp/plain/kernels/gemv_row.py kernels/gemv_row.py
for r in 1 2; do
    (cd /tmp/plain && export PYTHONPATH=/tmp/site:/tmp/plain && b1_graph "off-$r")
    b1_graph "on-$r"
done
mesh_ab 2 off on
for f in "$OUT"/mesh_*.json; do
    python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[1].rsplit('/',1)[1], [(r['batch'], r['throughput_tok_s'], r['decode_tok_s_per_request_median'], r['tokens_sha256']) for r in d['runs']])" "$f"
done
step sweep 120 python3 -m bench.gpu.gemv_b1_variants --variants dot core --fine \
    --shapes qkv gate_up lm_head
echo "=== session done, $((DEADLINE - $(date +%s)))s before the deadline"
