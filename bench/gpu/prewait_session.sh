#!/usr/bin/env bash
# Issue #9, tenth session: the WS GEMV's loader waiting for the predecessor after a few tiles
# (kernels/decode_chain/gemv.py WS_PREWAIT) for the products after a latency-bound kernel (o after the
# attention, qkv after the norm), so fewer weight bytes queue ahead of that kernel's loads; in
# the batch-1 step graph, variants alternating with this tree as committed (off), then the
# mesh at batch 1 for the best variant if it beat off.
#
#   git checkout d2c665a  # the tree with WS_PREWAIT (dropped after: every variant slower)
#   run(command="bash bench/gpu/prewait_session.sh", carry=[".whl", ".redisbin"])
SESSION_SECONDS=${SESSION_SECONDS:-330}
source "$(dirname "$0")/session_env.sh"
variant() {  # variant NAME WS_PREWAIT-dict
    rm -rf "/tmp/v_$1" && mkdir -p "/tmp/v_$1" && cp -r . "/tmp/v_$1/" 2>/dev/null
    sed -i "s/^WS_PREWAIT: dict\[tuple\[int, int\], int\] = {}/WS_PREWAIT: dict[tuple[int, int], int] = $2/" \
        "/tmp/v_$1/kernels/gemv.py"
    grep -n "^WS_PREWAIT" "/tmp/v_$1/kernels/gemv.py"
}
variant off '{}'
variant o2 '{(4096, 4096): 2}'
variant qkv2 '{(6144, 4096): 2}'
variant both2 '{(4096, 4096): 2, (6144, 4096): 2}'
step gpu-tests 60 python3 -m pytest -q -x -p no:cacheprovider \
    "tests/gpu/test_gemv_ws_cuda.py::test_loaders_that_wait_for_the_predecessor_change_no_bit" \
    2>&1 | tail -2
for r in 1 2; do
    for v in off o2 qkv2 both2; do
        (cd "/tmp/v_$v" && export PYTHONPATH=/tmp/site:/tmp/v_$v && b1_graph "$v-$r")
    done
done
b1_graph_report
best=$(python3 - "$OUT" <<'PY'
import glob, json, sys
ms = {}
for f in glob.glob(f"{sys.argv[1]}/b1_graph_*.json"):
    name = f.rsplit("/", 1)[1][len("b1_graph_"):].rsplit("-", 1)[0]
    ms.setdefault(name, []).append(json.load(open(f))["worker"][0]["breakdown"]["step_graph_ms"])
best = min(ms, key=lambda n: max(ms[n]))
print(best if best != "off" and max(ms[best]) < min(ms["off"]) else "")
PY
)
rm -f "$OUT"/b1_graph_*.json
echo "best variant, every run faster than every off run: ${best:-none}"
if [ -n "$best" ]; then
    for r in 1 2; do
        for v in off "$best"; do
            (cd "/tmp/v_$v" && export PYTHONPATH=/tmp/site:/tmp/v_$v && step "mesh-$v-$r" 40 \
                python3 -m bench.gpu.mesh_decode --batches 1 --out "$OUT/mesh_$v-$r.json" \
                | grep "^mesh")
        done
    done
fi
echo "=== session done, $((DEADLINE - $(date +%s)))s before the deadline"
