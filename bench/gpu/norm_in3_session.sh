#!/usr/bin/env bash
# (The norm-in GEMV these calls measured was dropped and its code removed after them:
# bench/gpu/norm_in_h200.log, which names the commits that have it.)
# Third device call for kernels/gemv_norm_in.py (issue #9). The first two
# (bench/gpu/norm_in_h200.log) had the batch-1 step graph at 9.3-9.4 ms with the norm-in
# GEMVs against 3.9 without, whatever the kernel's loop did: suspected, the PDL chain
# scheduling the norm-in GEMV's grid (192-224 programs) as soon as the GEMV before it starts,
# so its parked programs hold the SMs that GEMV's later programs need. Here: the GEMV before
# it releases it only once done (late trigger, "on"), or it is launched outside the chain
# ("nopdl"), against the norm kernels ("off"); the mesh if one of them gains.
#
#   run(command="bash bench/gpu/norm_in3_session.sh", carry=[".whl", ".redisbin"])
source "$(dirname "$0")/session_env.sh"

step gpu-tests 60 python3 -m pytest -q -x tests/gpu/test_decode_chain_cuda.py -k norm_in
plain_copy
sed -i 's/^NORM_IN_DEFAULT = True/NORM_IN_DEFAULT = False/' \
    /tmp/plain/services/worker/decode_chain.py
rm -rf /tmp/nopdl && cp -r . /tmp/nopdl
sed -i 's/^NORM_IN_PDL: bool | None = None/NORM_IN_PDL: bool | None = False/; s/^NORM_IN_LATE_TRIGGER = True/NORM_IN_LATE_TRIGGER = False/' \
    /tmp/nopdl/services/worker/decode_chain.py
grep -n "^NORM_IN" /tmp/nopdl/services/worker/decode_chain.py
for round in 1 2; do
    (cd /tmp/plain && export PYTHONPATH=/tmp/site:/tmp/plain && b1_graph "off-$round")
    b1_graph "on-$round"
    (cd /tmp/nopdl && export PYTHONPATH=/tmp/site:/tmp/nopdl && b1_graph "nopdl-$round")
done
gains=$(b1_graph_faster on off)
echo "on faster than off: $gains"
if [ "$gains" = 1 ]; then mesh_ab "${ROUNDS:-2}" off on; fi
echo "=== session done, $((DEADLINE - $(date +%s)))s before the deadline"
