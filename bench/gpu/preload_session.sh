#!/usr/bin/env bash
# One device call (issue #9, batch-1 decode): where a whole mesh-style decode step goes on the
# device (bench/gpu/decode_e2e.py --trace-steps: plans launched one ahead, input copies, the
# step graph, LM head, sampling, token copy), and an A/B of the GEMV's first weight tile loaded
# before its PDL wait (kernels/decode_chain/gemv.py PRELOAD_FIRST_TILE) on the batch-1 step graph and the
# 32-layer GEMV chain (bench/gpu/pdl_chain.py), alternating a copy with it off and this tree.
#
# Result (bench/gpu/preload_h200.log): the preload made things worse, batch-1 step graph 3.94 /
# 3.94 ms vs 3.86 / 3.84 without, the 32-layer weights alone 3.85 vs 3.69 ms, and the GEMV
# chain 3697 vs 3595 us at 1 row, 3902 vs 3729 at 16; so the code was removed again and
# re-running this script now compares two identical trees (its sed matches nothing).
#
#   run(command="bash bench/gpu/preload_session.sh", carry=[".whl", ".redisbin"])
source "$(dirname "$0")/session_env.sh"

step gpu-tests 200 python3 -m pytest -q -x tests/gpu/test_decode_chain_cuda.py \
    tests/gpu/test_decode_from_qkv_cuda.py tests/gpu/test_pdl_chain_cuda.py \
    tests/kernels/test_gemv.py tests/kernels/test_gemv_add_rmsnorm.py
step b1-steps 150 python3 -m bench.gpu.decode_e2e --batches 1 --skip-hf --max-model-len 1024 \
    --trace-steps "$OUT/b1_steps_trace.json" --out "$OUT/b1_preload_0.json"
plain_copy
sed -i 's/^PRELOAD_FIRST_TILE = True/PRELOAD_FIRST_TILE = False/' /tmp/plain/kernels/gemv.py
grep -n "^PRELOAD_FIRST_TILE" /tmp/plain/kernels/gemv.py
for round in 1 2; do
    (cd /tmp/plain && export PYTHONPATH=/tmp/site:/tmp/plain && step "b1-plain-$round" 100 \
        python3 -m bench.gpu.decode_e2e --batches 1 --skip-hf --max-model-len 1024 \
        --out "$OUT/b1_plain_$round.json")
    step "b1-preload-$round" 100 python3 -m bench.gpu.decode_e2e --batches 1 --skip-hf \
        --max-model-len 1024 --out "$OUT/b1_preload_$round.json"
done
(cd /tmp/plain && export PYTHONPATH=/tmp/site:/tmp/plain && step chain-plain 100 \
    python3 bench/gpu/pdl_chain.py)
step chain-preload 100 python3 bench/gpu/pdl_chain.py
grep -h '"step_graph_ms"' "$OUT"/b1_*.json
rm -f "$OUT/b1_steps_trace.json"
echo "=== session done, $((DEADLINE - $(date +%s)))s before the deadline"
