#!/usr/bin/env bash
# (The norms inside the decode GEMVs this call measured were dropped and removed after it:
# bench/gpu/norms_in_gemvs_h200.log names the commits that have them.)
# Third call on the norms inside the decode GEMVs (issue #9). Alone, the qkv GEMV with the
# norm loses ~3.9 us a launch and the others about break even; in the chain the step graph
# lost 0.37 ms. Here: the sites again with the norm's 1 / rms put on the accumulator instead
# of x (NORM_SCALES_ACCUMULATOR) and other qkv tiles, then the batch-1 step graph off (A, a
# copy with NORMS_IN_GEMVS_DEFAULT = False), exact (B, this tree) and scaled (C, a copy with
# NORM_SCALES_ACCUMULATOR = True), alternating.
#
#   run(command="bash bench/gpu/norms_in_gemvs_scaled_session.sh", carry=[".whl", ".redisbin"])
SESSION_SECONDS=${SESSION_SECONDS:-400}
source "$(dirname "$0")/session_env.sh"
step sites 150 python3 -m bench.gpu.norms_in_gemvs_kernels
plain_copy
sed -i 's/^NORMS_IN_GEMVS_DEFAULT = True/NORMS_IN_GEMVS_DEFAULT = False/' \
    /tmp/plain/services/worker/decode_chain.py
rm -rf /tmp/scaled && mkdir -p /tmp/scaled && cp -r . /tmp/scaled/ 2>/dev/null
sed -i 's/^NORM_SCALES_ACCUMULATOR = False/NORM_SCALES_ACCUMULATOR = True/' \
    /tmp/scaled/kernels/gemv.py
grep -n "^NORMS_IN_GEMVS_DEFAULT\|^NORM_SCALES_ACCUMULATOR" /tmp/plain/services/worker/decode_chain.py \
    /tmp/scaled/kernels/gemv.py kernels/decode_chain/gemv.py
for r in 1 2; do
    (cd /tmp/plain && export PYTHONPATH=/tmp/site:/tmp/plain && b1_graph "off-$r")
    b1_graph "exact-$r"
    (cd /tmp/scaled && export PYTHONPATH=/tmp/site:/tmp/scaled && b1_graph "scaled-$r")
done
echo "=== session done, $((DEADLINE - $(date +%s)))s before the deadline"
