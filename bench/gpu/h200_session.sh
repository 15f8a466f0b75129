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
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
LOG=$OUT/session.log
DEADLINE=$(($(date +%s) + ${SESSION_SECONDS:-560}))
export PYTHONUNBUFFERED=1
exec > >(tee -a "$LOG") 2>&1

if [ -z "${SKIP_WHEELS:-}" ]; then  # SKIP_WHEELS=1: a dry run of this script on the CPU box
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD
mkdir -p /tmp/rbin
cat > /tmp/rbin/redis-server <<EOF
#!/bin/sh
LD_LIBRARY_PATH=$PWD/.redisbin/root/usr/lib/x86_64-linux-gnu:$PWD/.redisbin/fallback \
exec $PWD/.redisbin/root/usr/bin/redis-server "\$@"
EOF
chmod +x /tmp/rbin/redis-server
export PATH=/tmp/rbin:$PATH
redis-server --version
python3 -c "import torch, triton, transformers as t; print(torch.__version__, triton.__version__, t.__version__)"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.draw \
    --format=csv

step() {  # step NAME CAP_SECONDS COMMAND...
    local name=$1 cap=$2
    shift 2
    local left=$((DEADLINE - $(date +%s)))
    local limit=$((cap < left ? cap : left))
    if ((limit < 10)); then
        echo "=== $name: not run ($left s left)"
        return
    fi
    echo "=== $name (limit ${limit}s)"
    local t0=$(date +%s)
    timeout -k 5 "$limit" "$@"
    echo "=== $name rc=$? $(($(date +%s) - t0))s"
}

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
