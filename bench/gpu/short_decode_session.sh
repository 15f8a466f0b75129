#!/usr/bin/env bash
# One device call (issue #9, batch-1 decode): the split policy for few programs at short
# contexts (kernels/attention/paged_decode.py `few_programs`: batch 1-2 run the strided kernel with the
# fused merge and a piece per 64-key tile) on the GPU tests, then through the mesh at batch 1
# and 16, alternating with the previous policy (the same tree with `few_programs` patched to
# False in a copy made for the baseline runs), twice each.
#
#   run(command="bash bench/gpu/short_decode_session.sh", carry=[".whl", ".redisbin"])
source "$(dirname "$0")/session_env.sh"

step gpu-tests 200 python3 -m pytest -q tests/gpu tests/kernels/test_paged_decode.py \
    tests/kernels/test_worker_triton_path.py tests/unit/worker/test_cuda_graphs.py
rm -rf /tmp/baseline && mkdir -p /tmp/baseline && cp -r . /tmp/baseline/ 2>/dev/null
sed -i 's/return num_seqs \* num_kv_heads \* 8 <= num_sms/return False/' \
    /tmp/baseline/kernels/paged_decode.py
grep -n "return False" /tmp/baseline/kernels/paged_decode.py | head -3
for round in 1 2; do
    step "mesh-new-$round" 100 python3 -m bench.gpu.mesh_decode --batches 1 16 \
        --out "$OUT/mesh_new_$round.json"
    (cd /tmp/baseline && export PYTHONPATH=/tmp/site:/tmp/baseline && step "mesh-old-$round" 100 \
        python3 -m bench.gpu.mesh_decode --batches 1 16 --out "$OUT/mesh_old_$round.json")
done
echo "=== session done, $((DEADLINE - $(date +%s)))s before the deadline"
