#!/usr/bin/env bash
# (The prefetch code this call measured was removed after it: bench/gpu/prefetch_h200.log.)
# One device call (issue #9, batch-1 decode): L2 prefetch of weights by the GEMVs launched
# early in the PDL chain (kernels.decode_chain.gemv prefetch_k; services/worker/accel/decode_chain.py
# O_PREFETCH_K, NORM_PREFETCH_K). GPU tests of the chain and GEMV, the batch-1 step graph
# (bench/gpu/decode_e2e.py) with o-projection prefetch off / on / on plus qkv and gate_up
# prefetch during the norms, then the mesh at batch 1 and 16 alternating off / on.
#
#   run(command="bash bench/gpu/prefetch_session.sh", carry=[".whl", ".redisbin"])
source "$(dirname "$0")/session_env.sh"

step gpu-tests 150 python3 -m pytest -q -x tests/gpu/test_decode_chain_cuda.py \
    tests/gpu/test_decode_from_qkv_cuda.py tests/kernels/test_gemv.py \
    tests/kernels/test_gemv_add_rmsnorm.py tests/kernels/test_decode_chain.py
graph() {  # graph NAME: the batch-1 step graph of the tree in the current directory
    step "b1-graph-$1" 100 python3 -m bench.gpu.decode_e2e --batches 1 --skip-hf \
        --max-model-len 1024 --out "$OUT/b1_graph_$1.json" | grep -o "'step_graph_ms': [0-9.]*"
}
plain_copy
sed -i 's/^O_PREFETCH_K = .*/O_PREFETCH_K = 0/' /tmp/plain/services/worker/decode_chain.py
grep -n "^O_PREFETCH_K" /tmp/plain/services/worker/decode_chain.py
rm -rf /tmp/norm && cp -r . /tmp/norm
sed -i 's/^NORM_PREFETCH_K = .*/NORM_PREFETCH_K = 256/' /tmp/norm/services/worker/decode_chain.py
for round in 1 2; do
    (cd /tmp/plain && export PYTHONPATH=/tmp/site:/tmp/plain && graph "off-$round")
    graph "o-$round"
    (cd /tmp/norm && export PYTHONPATH=/tmp/site:/tmp/norm && graph "o-norm-$round")
done
mesh_ab "${ROUNDS:-2}" off o
echo "=== session done, $((DEADLINE - $(date +%s)))s before the deadline"
