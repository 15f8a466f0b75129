#!/usr/bin/env bash
# Where a batch-1 step's device time goes inside the PDL chain (issue #9): one decode step
# traced by the PyTorch profiler (CUDA graph kernels included), each kernel's cost read as how
# much later the chain ends because of it (bench/gpu/chain_trace.py), for the serving code as
# it is (twice) and for the dropped norms-inside-the-GEMVs tree (commit 3e57968, carried as
# norms_tree.tar, an uncommitted archive, with this tree's two bench files copied in).
#
#   git archive 3e57968 -o norms_tree.tar   # optional: the dropped tree, untracked, travels along
#   run(command="bash bench/gpu/chain_trace_session.sh", carry=[".whl", ".redisbin"])
#   rm norms_tree.tar
SESSION_SECONDS=${SESSION_SECONDS:-420}
source "$(dirname "$0")/session_env.sh"
HERE=$PWD
trace() {  # trace NAME TREE
    (cd "$2" && export PYTHONPATH=/tmp/site:$2 && step "trace-$1" 120 python3 -m \
        bench.gpu.chain_trace --trace "/tmp/trace_$1.json" --kernels > "$OUT/chain_trace_$1.txt")
    grep -A 40 "^kind" "$OUT/chain_trace_$1.txt"
}
trace chain-1 "$HERE"
if [ -f norms_tree.tar ]; then
    mkdir -p /tmp/norms && tar -xf norms_tree.tar -C /tmp/norms
    cp bench/gpu/chain_trace.py bench/gpu/b1_step_kernels.py /tmp/norms/bench/gpu/
    trace norms /tmp/norms
fi
trace chain-2 "$HERE"
echo "=== session done, $((DEADLINE - $(date +%s)))s before the deadline"
