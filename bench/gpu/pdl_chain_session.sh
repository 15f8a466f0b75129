#!/usr/bin/env bash
# One device call (issue #9, batch-1 decode): the RMSNorm / GEMV / split-K reduce launches as a
# programmatic-dependent-launch chain (kernels/runtime/tensor_checks.py CHAIN_PDL_DEFAULT, on). GPU tests
# (the chain equals plain launches, eager and in a graph; GEMV and RMSNorm kernels; the worker
# path), the chain A/B in one graph (bench/gpu/pdl_chain.py), then the mesh at batch 1 and 16
# alternating between a copy of this tree with the chain off and this tree.
# Log of the runs that measured it (made with the default still off): bench/gpu/pdl_chain_h200.log.
#
#   run(command="bash bench/gpu/pdl_chain_session.sh", carry=[".whl", ".redisbin"])
source "$(dirname "$0")/session_env.sh"

step gpu-tests 200 python3 -m pytest -q -x tests/gpu/test_pdl_chain_cuda.py \
    tests/kernels/test_gemv.py tests/kernels/test_rmsnorm.py ${GPU_TESTS:-tests/gpu/test_worker_cuda.py}
step pdl-chain 120 python3 bench/gpu/pdl_chain.py
plain_copy
sed -i 's/^CHAIN_PDL_DEFAULT = True/CHAIN_PDL_DEFAULT = False/' /tmp/plain/kernels/tensor_checks.py
grep -n "^CHAIN_PDL_DEFAULT" /tmp/plain/kernels/tensor_checks.py
mesh_ab "${ROUNDS:-2}" plain pdl
echo "=== session done, $((DEADLINE - $(date +%s)))s before the deadline"
