#!/usr/bin/env bash
# (The prefetch code this call measured was removed after it: bench/gpu/kv_prefetch_h200.log.)
# One device call (issue #9, batch-1 decode): the fused decode attention's L2 prefetch of its
# first K/V tile while the qkv GEMV runs (kernels/decode_chain/decode_from_qkv.py KV_PREFETCH_DEFAULT).
# GPU tests, the batch-1 step graph (bench/gpu/decode_e2e.py) off / on twice, then the mesh at
# batch 1 and 16 alternating off / on.
#
#   run(command="bash bench/gpu/kv_prefetch_session.sh", carry=[".whl", ".redisbin"])
source "$(dirname "$0")/session_env.sh"

step gpu-tests 150 python3 -m pytest -q -x tests/gpu/test_decode_from_qkv_cuda.py \
    tests/gpu/test_decode_chain_cuda.py tests/kernels/test_decode_from_qkv.py
graph() {  # graph NAME: the batch-1 step graph of the tree in the current directory
    step "b1-graph-$1" 100 python3 -m bench.gpu.decode_e2e --batches 1 --skip-hf \
        --max-model-len 1024 --out "$OUT/b1_graph_$1.json" | grep -o "'step_graph_ms': [0-9.]*"
}
plain_copy
sed -i 's/^KV_PREFETCH_DEFAULT = True/KV_PREFETCH_DEFAULT = False/' \
    /tmp/plain/kernels/decode_from_qkv.py
grep -n "^KV_PREFETCH_DEFAULT" /tmp/plain/kernels/decode_from_qkv.py
for round in 1 2; do
    (cd /tmp/plain && export PYTHONPATH=/tmp/site:/tmp/plain && graph "off-$round")
    graph "on-$round"
done
mesh_ab "${ROUNDS:-2}" off on
rm -f "$OUT"/mesh_*.json "$OUT"/b1_graph_*.json  # the log has every number
echo "=== session done, $((DEADLINE - $(date +%s)))s before the deadline"
