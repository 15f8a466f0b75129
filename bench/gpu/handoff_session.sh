#!/usr/bin/env bash
# Eleventh session, review: the decode chain's PDL hand-off moved into one helper
# (kernels/runtime/pdl.py chain_handoff; the same two instructions inlined). The chain's GPU tests, then
# the batch-1 step graph of the tree before (base_tree.tar, `git archive` of 396f876) and this
# one, alternating twice.
#
#   run(command="bash bench/gpu/handoff_session.sh", carry=[".whl", ".redisbin"])
SESSION_SECONDS=${SESSION_SECONDS:-400}
source "$(dirname "$0")/session_env.sh"
step gpu-tests 180 python3 -m pytest -q -x tests/gpu/test_pdl_chain_cuda.py \
    tests/gpu/test_decode_chain_cuda.py tests/gpu/test_decode_from_qkv_cuda.py \
    tests/gpu/test_gemv_ws_cuda.py tests/gpu/test_no_host_sync_cuda.py 2>&1 | tail -3
rm -rf /tmp/plain && mkdir -p /tmp/plain && tar -xf base_tree.tar -C /tmp/plain && cp -r .whl .redisbin /tmp/plain/
b1_graph_ab 2
b1_graph_report
echo "=== session done, $((DEADLINE - $(date +%s)))s before the deadline"
