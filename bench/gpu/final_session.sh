#!/usr/bin/env bash
# One device call at the end of a session: every GPU and kernel test on the H200 with the
# defaults as committed (decode chain on), the mesh at batch 1, 16, 64 and 256 (prompt 512,
# output 128) twice around transformers `generate` at 64 and 256 in the same call, each with
# the worker's step timeline (where the GPU idles between steps, bench/step_timeline.py); the
# batch-1 step graph timed alone (bench/gpu/decode_e2e.py).
#
#   run(command="bash bench/gpu/final_session.sh", carry=[".whl", ".redisbin"])
#
# (The call that wrote bench/gpu/final_h200.log froze the heap in serve() itself and disabled
# it with "frozen = 0"; it now happens in run_service, disabled by the sed below.)
source "$(dirname "$0")/session_env.sh"

step gpu-tests 320 python3 -m pytest -q tests/gpu tests/kernels tests/unit/worker/test_cuda_graphs.py
# mesh-1: a copy of this tree without the start-up heap freeze (shared/service.py) and with
# the worker launching a plan before answering a landed step (services/worker/service.py), for
# the A/B of those changes around transformers in the same call; mesh-2: this tree.
plain_copy
sed -i 's/serve(service, freeze_heap=True)/serve(service)/' /tmp/plain/shared/service.py
sed -i 's/if self._in_flight is not None and self._in_flight.landed():/if False:/' \
    /tmp/plain/services/worker/service.py
grep -n "serve(service)\|if False:" /tmp/plain/shared/service.py /tmp/plain/services/worker/service.py
(cd /tmp/plain && export PYTHONPATH=/tmp/site:/tmp/plain && step mesh-1 120 python3 -m \
    bench.gpu.mesh_decode --batches 1 16 64 256 --out "$OUT/mesh_1.json" \
    --timeline "$OUT/timeline_1.jsonl")
step timeline-1 20 python3 -m bench.step_timeline "$OUT/timeline_1.jsonl" --split-ms 200
step transformers 150 python3 -m bench.gpu.decode_e2e --batches --hf-batches 64 256 \
    --out "$OUT/transformers.json"
step mesh-2 120 python3 -m bench.gpu.mesh_decode --batches 1 16 64 256 --out "$OUT/mesh_2.json" \
    --timeline "$OUT/timeline_2.jsonl"
step timeline-2 20 python3 -m bench.step_timeline "$OUT/timeline_2.jsonl" --split-ms 200
# mesh-3: this tree with three plans out at once (MESHLLM_SCHEDULE_AHEAD=3), batch 64 and 256.
step mesh-3 90 python3 -m bench.gpu.mesh_decode --batches 64 256 --out "$OUT/mesh_3.json" \
    --schedule-ahead 3 --timeline "$OUT/timeline_3.jsonl"
step timeline-3 20 python3 -m bench.step_timeline "$OUT/timeline_3.jsonl" --split-ms 200
step b1-graph 60 python3 -m bench.gpu.decode_e2e --batches 1 --skip-hf --max-model-len 1024 \
    --out "$OUT/b1_graph.json"
gzip -f "$OUT"/timeline_*.jsonl
echo "=== session done, $((DEADLINE - $(date +%s)))s before the deadline"
