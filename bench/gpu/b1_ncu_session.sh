#!/usr/bin/env bash
# Every kernel of one batch-1 decode step under Nsight Compute, one at a time (issue #9: where
# a batch-1 token goes, kernel by kernel, without the PDL overlap that blurs the PyTorch
# profiler's durations): bench/gpu/b1_step_kernels.py. Then the stall reasons of the fused decode
# attention and of the residual-add + RMSNorm kernel, and a GPU check of the bench helpers
# changed this session (graph_replays.captured).
#
#   run(command="bash bench/gpu/b1_ncu_session.sh", carry=[".whl", ".redisbin"])
SESSION_SECONDS=${SESSION_SECONDS:-400}
source "$(dirname "$0")/session_env.sh"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
echo "ncu: $NCU"
step ncu-step 200 "$NCU" --profile-from-start off --clock-control none --csv \
    --metrics gpu__time_duration.sum,dram__bytes_read.sum \
    python3 -m bench.gpu.b1_step_kernels > "$OUT/b1_step_kernels.csv"
tail -3 "$OUT/b1_step_kernels.csv"
step summary 20 python3 -m bench.gpu.b1_step_kernels --summarize "$OUT/b1_step_kernels.csv"
step ncu-detail 120 "$NCU" --profile-from-start off --clock-control none \
    -k regex:"decode_from_qkv|split_k_norm" -c 2 \
    --section SpeedOfLight --section WarpStateStats --section LaunchStats --section Occupancy \
    python3 -m bench.gpu.b1_step_kernels
step helpers 60 python3 -c "
import torch
from bench.gpu.kernel_timings import graph_ms
from kernels.decode_chain.gemv import gemv
w = torch.randn(4096, 4096, device='cuda', dtype=torch.bfloat16); x = torch.randn(1, 4096, device='cuda', dtype=torch.bfloat16)
print('graph_ms gemv 4096x4096 one row: %.2f us' % (1e3 * graph_ms([lambda: gemv(x, w)])))
"
step variants-quick 60 python3 -m bench.gpu.gemv_b1_variants --quick --shapes o
echo "=== session done, $((DEADLINE - $(date +%s)))s before the deadline"
