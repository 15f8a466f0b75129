#!/usr/bin/env bash
# Variants of the one-row warp-specialized GEMV (kernels/decode_chain/gemv_ws.py) in the batch-1 step graph,
# each a copy of this tree changed by sed, run in turns with the tensor-core GEMV (off):
# s9 = this tree (rings of 9 stages of 16 KB); s9lm = the LM head on it too; gu64 = gate_up in
# 64 x 128 tiles. Then the GPU tests of the tree as it is, one traced step of s9 and s9lm, and
# with MESH=N the mesh at batch 1 and 16, off against this tree, N rounds. (Earlier calls of
# this script, with other variants: bench/gpu/gemv_ws_h200.log.)
#
# Its variants are seds of commit e7f2d24's kernels/decode_chain/gemv.py and gemv_ws.py (the loader's L2
# prefetch, L2_PREFETCH_STEPS, was removed after it and down's tiles changed to 32 x 256):
#   git checkout e7f2d24; run(command="bash bench/gpu/gemv_ws_variants_session.sh", carry=[".whl", ".redisbin"])
SESSION_SECONDS=${SESSION_SECONDS:-570}
source "$(dirname "$0")/session_env.sh"
HERE=$PWD
variant() {  # variant NAME SED_SCRIPT FILE
    rm -rf "/tmp/v_$1" && mkdir -p "/tmp/v_$1" && cp -r . "/tmp/v_$1/" 2>/dev/null
    [ -n "$2" ] && sed -i "$2" "/tmp/v_$1/$3"
    grep -n "^GEMV_WS_DEFAULT\|^L2_PREFETCH_STEPS\|num_stages=[0-9]*),$" \
        "/tmp/v_$1/kernels/gemv.py" "/tmp/v_$1/kernels/gemv_ws.py"
}
variant off 's/^GEMV_WS_DEFAULT = True/GEMV_WS_DEFAULT = False/' kernels/decode_chain/gemv.py
variant s9 '' kernels/decode_chain/gemv.py
variant s9lm '/(4096, 14336): GemvConfig(block_n=64, block_k=128, split_k=4, num_warps=4, num_stages=9),/a\    (128256, 4096): GemvConfig(block_n=32, block_k=256, split_k=1, num_warps=4, num_stages=9),' kernels/decode_chain/gemv.py
variant gu64 's/(28672, 4096): GemvConfig(block_n=32, block_k=256, split_k=1, num_warps=4, num_stages=9)/(28672, 4096): GemvConfig(block_n=64, block_k=128, split_k=1, num_warps=4, num_stages=9)/' kernels/decode_chain/gemv.py
for r in 1 2; do
    for v in ${VARIANTS:-off s9 s9lm gu64}; do
        (cd "/tmp/v_$v" && export PYTHONPATH=/tmp/site:/tmp/v_$v && b1_graph "$v-$r")
    done
done
b1_graph_report
rm -f "$OUT"/b1_graph_*.json  # printed above; fewer files to bring back
step gpu-tests 120 python3 -m pytest -q -x -p no:cacheprovider tests/gpu/test_gemv_ws_cuda.py \
    tests/gpu/test_decode_chain_cuda.py
for v in ${TRACE:-s9 s9lm}; do
    (cd "/tmp/v_$v" && export PYTHONPATH=/tmp/site:/tmp/v_$v && step "trace-$v" 60 python3 -m \
        bench.gpu.chain_trace --trace "/tmp/trace_$v.json" --kernels > "$OUT/chain_trace_$v.txt")
done
for v in ${TRACE:-s9 s9lm}; do grep -A 14 "^kind" "$OUT/chain_trace_$v.txt"; done
if [ -n "${MESH:-}" ]; then
    rm -rf /tmp/plain && cp -r /tmp/v_off /tmp/plain
    mesh_ab "$MESH" off on
    for f in "$OUT"/mesh_*.json; do
        python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[1].rsplit('/',1)[1], [(r['batch'], r['throughput_tok_s'], r['decode_tok_s_per_request_median'], r['tokens_sha256'][:12]) for r in d['runs']])" "$f"
    done
fi
echo "=== session done, $((DEADLINE - $(date +%s)))s before the deadline"
