#!/usr/bin/env bash
# The decode MLP's gate_up and down in one warp-specialized launch with a grid barrier
# (kernels/decode_chain/gemv_ws.py _mlp_ws_kernel, kernels/decode_chain/gemv.py gemv_mlp_add_rmsnorm): its GPU tests,
# then the batch-1 step graph of three trees in turns: off (the tensor-core GEMVs), ws2 (the
# WS GEMVs, gate_up and down as two launches: MLP_WS_DEFAULT = False) and this tree; one
# traced step of this tree; the mesh at batch 1 and 16, off against this tree; and the whole
# GPU suite. If the MLP's tests fail, the rest runs with it off.
#
# Ran once, on commit 53f5e9d (the MLP was dropped after it: bench/gpu/mlp_ws_h200.log):
#   git checkout 53f5e9d; run(command="bash bench/gpu/mlp_ws_session.sh", carry=[".whl", ".redisbin"])
SESSION_SECONDS=${SESSION_SECONDS:-590}
source "$(dirname "$0")/session_env.sh"
copy() {  # copy NAME SED_SCRIPT FILE: this tree at /tmp/v_NAME, changed by sed
    rm -rf "/tmp/v_$1" && mkdir -p "/tmp/v_$1" && cp -r . "/tmp/v_$1/" 2>/dev/null
    sed -i "$2" "/tmp/v_$1/$3"
    grep -n "^GEMV_WS_DEFAULT\|^MLP_WS_DEFAULT" "/tmp/v_$1/$3"
}
copy off 's/^GEMV_WS_DEFAULT = True/GEMV_WS_DEFAULT = False/' kernels/decode_chain/gemv.py
copy ws2 's/^MLP_WS_DEFAULT = True/MLP_WS_DEFAULT = False/' kernels/decode_chain/gemv.py
step mlp-tests 120 python3 -m pytest -q -x -p no:cacheprovider tests/gpu/test_gemv_ws_cuda.py \
    tests/gpu/test_decode_chain_cuda.py tests/gpu/test_decode_from_qkv_cuda.py \
    tests/gpu/test_pdl_chain_cuda.py
sleep 1
if ! grep -q "^=== mlp-tests rc=0 " "$LOG"; then
    echo "=== the MLP's tests failed: MLP_WS_DEFAULT = False from here on"
    sed -i 's/^MLP_WS_DEFAULT = True/MLP_WS_DEFAULT = False/' kernels/decode_chain/gemv.py
    NO_SUITE=1
fi
for r in 1 2; do
    for v in off ws2; do
        (cd "/tmp/v_$v" && export PYTHONPATH=/tmp/site:/tmp/v_$v && b1_graph "$v-$r")
    done
    b1_graph "tree-$r"
done
b1_graph_report
rm -f "$OUT"/b1_graph_*.json  # printed above; fewer files to bring back
step trace 60 python3 -m bench.gpu.chain_trace --trace /tmp/trace_tree.json --kernels \
    > "$OUT/chain_trace_mlp.txt"
grep -A 14 "^kind" "$OUT/chain_trace_mlp.txt"
rm -rf /tmp/plain && cp -r /tmp/v_off /tmp/plain
mesh_ab 1 off on
for f in "$OUT"/mesh_*.json; do
    python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[1].rsplit('/',1)[1], [(r['batch'], r['throughput_tok_s'], r['decode_tok_s_per_request_median'], r['tokens_sha256'][:12]) for r in d['runs']])" "$f"
done
if [ -z "${NO_SUITE:-}" ]; then
    step gpu-suite 300 python3 -m pytest -q -p no:cacheprovider tests/gpu tests/kernels \
        tests/unit/worker/test_cuda_graphs.py | tail -4
fi
echo "=== session done, $((DEADLINE - $(date +%s)))s before the deadline"
