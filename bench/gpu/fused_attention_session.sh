#!/usr/bin/env bash
# One device call (issue #9, batch-1 decode): the chain's attention from the qkv partials in
# one kernel (kernels/decode_chain/decode_from_qkv.py: split-K reduce + RoPE/KV insert + strided decode).
# GPU tests of the kernel and the chain, the batch-1 step graph with its kernel trace
# (bench/gpu/decode_e2e.py), then the mesh at batch 1 and 16 alternating between a copy of
# this tree with the fused attention off and this tree.
#
#   run(command="bash bench/gpu/fused_attention_session.sh", carry=[".whl", ".redisbin"])
source "$(dirname "$0")/session_env.sh"

step gpu-tests 200 python3 -m pytest -q -x tests/gpu/test_decode_from_qkv_cuda.py \
    tests/gpu/test_decode_chain_cuda.py tests/kernels/test_decode_from_qkv.py \
    tests/kernels/test_paged_decode.py tests/kernels/test_decode_chain.py \
    tests/kernels/test_kv_insert.py tests/kernels/test_gemv.py
step b1-graph 150 python3 -m bench.gpu.decode_e2e --batches 1 --skip-hf --max-model-len 1024 \
    --trace "$OUT/b1_graph_trace.json" --out "$OUT/b1_graph.json"
plain_copy
sed -i 's/^FUSED_ATTENTION_DEFAULT = True/FUSED_ATTENTION_DEFAULT = False/' \
    /tmp/plain/services/worker/decode_chain.py
grep -n "^FUSED_ATTENTION_DEFAULT" /tmp/plain/services/worker/decode_chain.py
(cd /tmp/plain && export PYTHONPATH=/tmp/site:/tmp/plain && step b1-graph-plain 150 \
    python3 -m bench.gpu.decode_e2e --batches 1 --skip-hf --max-model-len 1024 \
    --out "$OUT/b1_graph_plain.json")
mesh_ab "${ROUNDS:-2}" plain fused
rm -f "$OUT/b1_graph_trace.json"
echo "=== session done, $((DEADLINE - $(date +%s)))s before the deadline"
