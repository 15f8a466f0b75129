#!/usr/bin/env bash
# One device call (issue #9): every GPU and kernel test on the H200, the SiLU-and-multiply
# kernel against eager (bench/gpu/silu_mul_bench.py), then whole decode steps at batch 1, 64
# and 256 traced (bench/gpu/decode_e2e.py --trace-steps) for a copy of this tree whose kernels/
# and services/ are those of .basetree (the eager silu * up and the launches per step as they
# were), then for this tree. Here, first (.basetree is in .git/info/exclude):
#
#   rm -rf .basetree && mkdir .basetree && git archive ea59703 kernels services | tar -x -C .basetree
#   run(command="bash bench/gpu/step_launches_session.sh", carry=[".whl", ".redisbin", ".basetree"])
SESSION_SECONDS=${SESSION_SECONDS:-580}
source "$(dirname "$0")/session_env.sh"

step gpu-tests 330 python3 -m pytest -q tests/gpu tests/kernels tests/unit/worker/test_cuda_graphs.py
step silu-mul 40 python3 -m bench.gpu.silu_mul_bench
plain_copy
cp -r .basetree/kernels .basetree/services /tmp/plain/
grep -c "silu_mul" /tmp/plain/services/worker/cuda_layers.py  # 0: the base
(cd /tmp/plain && export PYTHONPATH=/tmp/site:/tmp/plain && step steps-base 90 python3 -m \
    bench.gpu.decode_e2e --batches 1 64 256 --skip-hf --max-model-len 1024 --warm-tokens 0 \
    --trace-steps "$OUT/base_trace.json" --out "$OUT/steps_base.json")
step steps-new 90 python3 -m bench.gpu.decode_e2e --batches 1 64 256 --skip-hf \
    --max-model-len 1024 --warm-tokens 0 --trace-steps "$OUT/new_trace.json" \
    --out "$OUT/steps_new.json"
gzip -f "$OUT"/*_trace_b*.json
echo "=== session done, $((DEADLINE - $(date +%s)))s before the deadline"
