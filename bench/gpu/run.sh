#!/usr/bin/env bash
# The GPU test suite and the GPU benchmarks on a CUDA machine without network, from the tree
# root, results under $OUT.
#
#   make gpu-bundle          # here, once: .whl/, .redisbin/, .tokenizer/ (bench/gpu/bundle.sh)
#   bash bench/gpu/run.sh [all|tests|bench|serve]   # there, with .whl/, .redisbin/, .tokenizer/
#
# The machine needs Python 3.12 with torch (CUDA), triton and transformers installed (the
# bundle brings the rest) and glibc >= 2.34. Steps:
#   1. install the wheels into /tmp/site (pip --no-index --no-deps --target; PYTHONPATH), put
#      the bundled redis-server first on PATH, print the versions and the GPU's clocks;
#   2. tests: tests/gpu, tests/kernels (compiled Triton at real sizes, not the interpreter)
#      and tests/unit/worker/test_{cuda,verify}_graphs.py;
#   3. bench: bench.gpu.kernel_timings; bench.gpu.mesh_decode at batch 1/16/64/256 (redis-server
#      + scheduler + worker processes, Llama-3-8B shape, random bf16 weights, prompt 512,
#      output 128); bench.baseline_transformers on the same shape at 1/64/256 (warmed,
#      best-of-2); then the mesh / transformers ratio per batch.
#   4. serve (only when asked for: `run.sh serve`): bench.gpu.gateway_serve, the same shape with
#      the SmolLM2 tokenizer through the gateway, driven by `vllm bench serve` when the call
#      carries .vllmclient/ (`make vllm-client`), and by bench/serve.py (gateway cost against
#      the scheduler-direct path, datasets, request rates, 8k/32k prompts); SERVE_ARGS adds
#      gateway_serve flags (e.g. "--cost-only --concurrency 64 256"), SERVE_CLIENTS="vllm"
#      leaves bench/serve.py out.
#   5. spec (only when asked for: `run.sh spec`): n-gram speculation with the real SmolLM2
#      weights (bench/gpu/weights.sh brings them): bench.spec_ngram at batch 1 and 16 and
#      bench.gpu.spec_serve through the gateway (SPEC_BATCHES="16": that batch/concurrency only);
#      spec_ngram_b*.json also holds each kernel's device time in one plain and one speculative
#      run of the edit task (`kernel_profile`); MESHLLM_GEMV_MAX_ROWS=96 runs its verify steps
#      (16 x 6 rows) on the GEMV + decode chain, MESHLLM_PREFILL_GRAPH_TOKENS=2048 its prompt
#      chunks from CUDA graphs, in-process and through the gateway; SPEC_PREFILL_GRAPHS="0 2048"
#      runs the in-process part once per value (spec_ngram_b*_pg*.json); SPEC_K="5 8" runs it once
#      per number of drafts K (spec_ngram_b*_pg*_k*.json) and the gateway part with the last K;
#      the gateway part also runs a mesh whose verify steps wait for the host (--against
#      unchained: MESHLLM_SPEC_DEVICE_CHAIN=off, the A/B of chaining them on the device; SPEC_
#      AGAINST="carried unchained" adds drafts carried by the scheduler) and writes each mesh's
#      step timeline to $OUT/timeline.
#   6. rows (only when asked for): bench.gpu.mesh_decode at batch 32 and 64 with steps past 16
#      rows on cuBLAS, then on the GEMV + decode chain (--gemv-max-rows 16 / 64).
# Written under $OUT (default /tmp/meshllm-gpu): run.log (everything printed), gpu_tests.log,
# gpu_failures.log (each failing test's report, written when it fails),
# kernel_timings.json, mesh_decode.json, transformers.json, gateway_serve.json. Each step runs
# under what is left of BUDGET_S seconds (default 570) and its own cap, so one slow step cannot
# starve the rest: `tests` alone takes ~6-7 min on a fresh H200 machine (cold Triton caches),
# `bench` ~5 min.
set -uo pipefail
MODE=${1:-all}
case $MODE in all | tests | bench | serve | spec | rows) ;; *) echo "usage: $0 [all|tests|bench|serve|spec|rows]" >&2; exit 2 ;; esac
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT"
OUT=${OUT:-/tmp/meshllm-gpu}
mkdir -p "$OUT"
DEADLINE=$(($(date +%s) + ${BUDGET_S:-570}))
export PYTHONUNBUFFERED=1
exec > >(tee -a "$OUT/run.log") 2>&1

for need in .whl .redisbin/redis-server .tokenizer/tokenizer.json; do
    [ -e "$need" ] || { echo "$need missing: run \`make gpu-bundle\` and copy it along" >&2; exit 2; }
done
SITE=${SITE:-/tmp/site}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" .whl/*.whl || exit 1
export PYTHONPATH=$SITE:$ROOT
export PATH=$ROOT/.redisbin:$PATH
redis-server --version || exit 1
python3 -c "import sys, torch, triton, transformers as t
print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__,
      'transformers', t.__version__, 'cuda', torch.cuda.is_available())"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.draw \
    --format=csv

FAILED=0
step() {  # step NAME CAP_SECONDS COMMAND...: COMMAND under min(CAP, what is left)
    local name=$1 cap=$2
    shift 2
    local left=$((DEADLINE - $(date +%s)))
    local limit=$((cap < left ? cap : left))
    if ((limit < 10)); then
        echo "=== $name: not run, ${left}s left"
        FAILED=1
        return
    fi
    echo "=== $name (limit ${limit}s)"
    local started
    started=$(date +%s)
    timeout -k 5 "$limit" "$@"
    local rc=$?
    echo "=== $name rc=$rc $(($(date +%s) - started))s"
    ((rc == 0)) || FAILED=1
}

if [ "$MODE" = spec ]; then
    # The real SmolLM2 weights: parts 1 and 2 stashed in $WEIGHTS by earlier calls, part 0
    # carried with this one (bench/gpu/weights.sh, `make gpu-weights`).
    WEIGHTS=${WEIGHTS:-/tmp/w}
    if [ -d .weights0 ]; then bash bench/gpu/weights.sh stash 0 "$WEIGHTS"; fi
    bash bench/gpu/weights.sh join "$WEIGHTS" || exit 1
    GGUF=$WEIGHTS/SmolLM2-135M-Instruct.Q4_1.gguf
    # SPEC_PREFILL_GRAPHS="0 2048": the in-process runs once per value (eager prompt chunks,
    # then chunks of up to 2048 tokens from CUDA graphs), an A/B on one machine in one call.
    for k in ${SPEC_K:-5}; do
        for pg in ${SPEC_PREFILL_GRAPHS:-${MESHLLM_PREFILL_GRAPH_TOKENS:-0}}; do
            for batch in ${SPEC_BATCHES:-1 16}; do
                step "spec-ngram-b$batch-pg$pg-k$k" 150 python3 -m bench.spec_ngram --device cuda \
                    --model "$GGUF" --batch "$batch" --repeats 3 --kernel-profile --k "$k" \
                    --gemv-max-rows "${MESHLLM_GEMV_MAX_ROWS:-16}" --prefill-graph-tokens "$pg" \
                    --step-marks --out "$OUT/spec_ngram_b${batch}_pg${pg}_k$k.json"
            done
        done
    done
    # shellcheck disable=SC2086 # SPEC_BATCHES is a list of numbers: one argument each
    step spec-serve 300 python3 -m bench.gpu.spec_serve --model "$GGUF" --k "$k" \
        --concurrency ${SPEC_BATCHES:-1 16} --repeats 4 --against ${SPEC_AGAINST:-unchained} --step-timeline "$OUT/timeline" \
        --prefill-graph-tokens "${MESHLLM_PREFILL_GRAPH_TOKENS:-0}" --out "$OUT/spec_serve.json"
fi
if [ "$MODE" = rows ]; then
    # The GEMV + decode chain against cuBLAS past 16 rows: the same mesh_decode at batch 32 and
    # 64 with steps of up to 16 rows (cuBLAS above) and up to 64 rows on the GEMV.
    for rows in 16 64; do
        step "mesh-decode-rows$rows" 200 python3 -m bench.gpu.mesh_decode --batches 32 64 \
            --repeats 2 --gemv-max-rows "$rows" --out "$OUT/mesh_decode_rows$rows.json"
    done
fi
if [ "$MODE" = serve ]; then
    # `vllm bench serve` where `make vllm-client` built it and the call carried
    # .vllmclient/vllm-src.tar.gz and .vllmclient/wheels (bench/vllm_client.sh); it drives the
    # datasets, and the gateway-cost runs beside bench/serve.py.
    CLIENTS=builtin
    if [ -f .vllmclient/vllm-src.tar.gz ]; then
        mkdir -p /tmp/vllmclient/src
        tar -xzf .vllmclient/vllm-src.tar.gz -C /tmp/vllmclient/src &&
            python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
                --upgrade --target /tmp/vllmclient/site .vllmclient/wheels/*.whl || exit 1
        export MESHLLM_VLLM_CLIENT_PATH=/tmp/vllmclient/site:/tmp/vllmclient/src
        if python3 -m bench.vllm_client --help >"$OUT/vllm_client_check.log" 2>&1; then
            CLIENTS=${SERVE_CLIENTS:-vllm builtin}
        else
            echo "vllm bench serve does not start here (bench/serve.py alone drives the runs):"
            tail -20 "$OUT/vllm_client_check.log"
        fi
    fi
    # shellcheck disable=SC2086 # CLIENTS: one argument each
    step gateway-serve 560 python3 -m bench.gpu.gateway_serve --tokenizer .tokenizer \
        --client $CLIENTS --logs "$OUT/serve_logs" --out "$OUT/gateway_serve.json" ${SERVE_ARGS:-}
fi
if [ "$MODE" = all ] || [ "$MODE" = tests ]; then
    # Failures are written to gpu_failures.log as they happen (tests/conftest.py): the step's
    # time limit may cut the run before pytest's own failure section.
    export MESHLLM_TEST_FAILURES=$OUT/gpu_failures.log
    step gpu-tests 480 bash -c "set -o pipefail; python3 -m pytest -q -p no:cacheprovider \
        tests/gpu tests/kernels tests/unit/worker/test_cuda_graphs.py \
        tests/unit/worker/test_verify_graphs.py 2>&1 | tee '$OUT/gpu_tests.log'"
fi
if [ "$MODE" = all ] || [ "$MODE" = bench ]; then
    step kernel-timings 150 python3 -m bench.gpu.kernel_timings --out "$OUT/kernel_timings.json"
    step mesh-decode 180 python3 -m bench.gpu.mesh_decode --batches 1 16 64 256 --repeats 2 \
        --out "$OUT/mesh_decode.json"
    step transformers 200 python3 -m bench.baseline_transformers --model random:llama-3-8b \
        --device cuda --dtype bfloat16 --batch 1 64 256 --input-len 512 --output-len 128 \
        --repeats 2 --out "$OUT/transformers.json"
    python3 - "$OUT" <<'PY'
"""Best output tok/s per batch: the mesh and transformers, and their ratio."""
import json
import sys
from pathlib import Path

out = Path(sys.argv[1])
try:
    mesh = json.loads((out / "mesh_decode.json").read_text())["best_tok_s"]
    hf = {str(r["batch"]): r["best_tok_s"]
          for r in json.loads((out / "transformers.json").read_text())["runs"]}
except (OSError, KeyError, ValueError) as exc:
    sys.exit(f"no summary: {exc!r}")
print("| batch | mesh tok/s (best) | transformers tok/s (best, warmed) | mesh / transformers |")
print("|---|---|---|---|")
for batch, tok_s in mesh.items():
    ratio = f"{tok_s / hf[batch]:.2f}x" if batch in hf else ""
    print(f"| {batch} | {tok_s} | {hf.get(batch, '')} | {ratio} |")
PY
fi
echo "=== done ($MODE), $((DEADLINE - $(date +%s)))s of the budget left; results in $OUT"
exit $FAILED
