#!/usr/bin/env bash
# The one-row GEMV with a TMA loader warp that streams weights ahead of the PDL wait
# (kernels/decode_chain/gemv_ws.py, issue #9 at batch 1): its GPU tests and the decode-chain tests, then
# the batch-1 step graph with it off (A: a copy of this tree with GEMV_WS_DEFAULT = False) and
# on (B), alternating, and one traced step with it on (bench/gpu/chain_trace.py).
#
#   run(command="bash bench/gpu/gemv_ws_session.sh", carry=[".whl", ".redisbin"])
SESSION_SECONDS=${SESSION_SECONDS:-570}
source "$(dirname "$0")/session_env.sh"
step gpu-tests 170 python3 -m pytest -q -x -p no:cacheprovider tests/gpu/test_gemv_ws_cuda.py \
    tests/gpu/test_decode_chain_cuda.py tests/gpu/test_decode_from_qkv_cuda.py \
    tests/gpu/test_pdl_chain_cuda.py
plain_copy
sed -i 's/^GEMV_WS_DEFAULT = True/GEMV_WS_DEFAULT = False/' /tmp/plain/kernels/gemv.py
grep -n "^GEMV_WS_DEFAULT" /tmp/plain/kernels/gemv.py kernels/decode_chain/gemv.py
b1_graph_ab 2
step trace-on 120 python3 -m bench.gpu.chain_trace --trace /tmp/trace_on.json --kernels \
    > "$OUT/chain_trace_ws.txt"
grep -A 40 "^kind" "$OUT/chain_trace_ws.txt"
if [ -n "${WITH_MESH:-}" ]; then mesh_ab 1 off on; fi
echo "=== session done, $((DEADLINE - $(date +%s)))s before the deadline"
