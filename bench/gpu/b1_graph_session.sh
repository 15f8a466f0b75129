#!/usr/bin/env bash
# One device call (issue #9, batch-1 decode): where the batch-1 step graph's time goes. The
# worker alone at batch 1 (bench/gpu/decode_e2e.py: the step graph, the weights alone, the
# attention alone) with a kernel trace of 10 replays of the step graph: each kernel's time and
# the gaps between kernels inside the graph, by kernel pair (bench/kernel_trace.py).
#
#   run(command="bash bench/gpu/b1_graph_session.sh", carry=[".whl", ".redisbin"])
source "$(dirname "$0")/session_env.sh"

step b1-graph 200 python3 -m bench.gpu.decode_e2e --batches 1 --skip-hf --max-model-len 1024 \
    --trace "$OUT/b1_graph_trace.json" --out "$OUT/b1_graph.json"
step pdl-chain 90 python3 bench/gpu/pdl_chain.py
rm -f "$OUT/b1_graph_trace.json"
echo "=== session done, $((DEADLINE - $(date +%s)))s before the deadline"
