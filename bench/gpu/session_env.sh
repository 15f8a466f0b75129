#!/usr/bin/env bash
# Sourced by the device-session scripts (h200_session.sh, overlap_session.sh): installs the
# carried wheels, puts the carried redis-server on PATH, prints the machine, and defines
# `step NAME CAP_SECONDS COMMAND...`, which runs a command within what is left of the
# session's deadline (SESSION_SECONDS, default 560) so one slow step cannot cost the next.
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


plain_copy() {  # a fresh copy of this tree at /tmp/plain, for the A side of an A/B (sed it after)
    rm -rf /tmp/plain && mkdir -p /tmp/plain && cp -r . /tmp/plain/ 2>/dev/null
}

mesh_ab() {  # mesh_ab ROUNDS NAME_A NAME_B: the mesh at batch 1 and 16, /tmp/plain (A) then this
    local rounds=$1 a=$2 b=$3 round    # tree (B), alternating; JSON to $OUT/mesh_<name>_<round>
    for round in $(seq 1 "$rounds"); do
        (cd /tmp/plain && export PYTHONPATH=/tmp/site:/tmp/plain && step "mesh-$a-$round" \
            100 python3 -m bench.gpu.mesh_decode --batches 1 16 --out "$OUT/mesh_${a}_$round.json")
        step "mesh-$b-$round" 100 python3 -m bench.gpu.mesh_decode --batches 1 16 \
            --out "$OUT/mesh_${b}_$round.json"
    done
}

b1_graph() {  # b1_graph NAME: the batch-1 step graph of the tree in the current directory
    step "b1-graph-$1" 60 python3 -m bench.gpu.decode_e2e --batches 1 --skip-hf \
        --max-model-len 1024 --out "$OUT/b1_graph_$1.json" | grep -o "'step_graph_ms': [0-9.]*"
}

b1_graph_ab() {  # b1_graph_ab ROUNDS: the batch-1 step graph of /tmp/plain (off-N) then this
    local r                    # tree (on-N), alternating, ROUNDS times
    for r in $(seq 1 "$1"); do
        (cd /tmp/plain && export PYTHONPATH=/tmp/site:/tmp/plain && b1_graph "off-$r")
        b1_graph "on-$r"
    done
}

b1_graph_report() {  # b1_graph_report: the step graph ms of every b1_graph run in $OUT
    python3 - "$OUT" <<'PY'
import glob, json, sys
for f in sorted(glob.glob(f"{sys.argv[1]}/b1_graph_*.json")):
    print(f.rsplit("/", 1)[1], round(json.load(open(f))["worker"][0]["breakdown"]["step_graph_ms"], 4))
PY
}

b1_graph_faster() {  # b1_graph_faster A B: prints 1 if A's best b1_graph (runs "A-<n>") beat B's
    python3 - "$OUT" "$1" "$2" <<'PY'
import glob, json, sys

def best_ms(name):
    files = glob.glob(f"{sys.argv[1]}/b1_graph_{name}-[0-9]*.json")
    return min(json.load(open(f))["worker"][0]["breakdown"]["step_graph_ms"] for f in files)

print(int(best_ms(sys.argv[2]) < best_ms(sys.argv[3])))
PY
}
