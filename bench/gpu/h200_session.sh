#!/usr/bin/env bash
# One device call on the H200 (issue #9 follow-up): every measurement and GPU test of
# bench/gpu/decode_h200.md, written under $OUT (at most 8 files come back: 4 JSON + 1 log).
#
#   run(command="bash bench/gpu/h200_session.sh", carry=[".whl", ".redisbin"])
#
# .whl holds the wheels the GPU image lacks (pydantic, pydantic-settings, redis, hiredis,
# fastapi, starlette, uvicorn, ...), .redisbin a Debian redis-server unpacked with its
# libraries (both git-ignored, made on the CPU machine: see decode_h200.md). Each step gets
# what is left of a global deadline, so one slow step cannot cost the ones after it.
source "$(dirname "$0")/session_env.sh"

step dense-test 60 python3 -m pytest -q -s tests/gpu/test_dense_prefill_cuda.py
step prefill-step 60 python3 -m bench.gpu.prefill_step --out "$OUT/prefill_step.json"
step decode-e2e 170 python3 -m bench.gpu.decode_e2e --out "$OUT/decode_e2e.json"
step mesh-async 90 python3 -m bench.gpu.mesh_decode --async-scheduling true \
    --out "$OUT/mesh_async.json"
step mesh-sync 90 python3 -m bench.gpu.mesh_decode --async-scheduling false \
    --out "$OUT/mesh_sync.json"
step hf-rope 20 python3 -m bench.gpu.hf_rope
step parity-2l-fp32-as-before 30 python3 -m bench.gpu.parity_probe --layers 2 --fp32 \
    --plain-config --keep-bf16-inv-freq
step parity-2l-fp32 30 python3 -m bench.gpu.parity_probe --layers 2 --fp32
step gpu-tests 200 python3 -m pytest -q -s tests/gpu tests/kernels/test_worker_triton_path.py \
    tests/unit/worker/test_cuda_graphs.py tests/unit/worker/test_dense_prefill.py
step parity-bf16 60 python3 -m bench.gpu.parity_probe --layers 2 32
echo "=== session done, $((DEADLINE - $(date +%s)))s before the deadline"
