#!/usr/bin/env bash
# The sixth session's last call (issue #9) on the committed tree (serving code as a32a40f):
# the batch-1 step graph through decode_e2e (its graphed() now captures through
# graph_replays.captured), the mesh at batch 1 and 64 twice around transformers `generate` at 64.
#
#   run(command="bash bench/gpu/sixth_final_session.sh", carry=[".whl", ".redisbin"])
SESSION_SECONDS=${SESSION_SECONDS:-400}
source "$(dirname "$0")/session_env.sh"
b1_graph final
step mesh-1 75 python3 -m bench.gpu.mesh_decode --batches 1 64 --out "$OUT/mesh_1.json"
step transformers 110 python3 -m bench.gpu.decode_e2e --batches --hf-batches 64 \
    --out "$OUT/transformers.json"
step mesh-2 75 python3 -m bench.gpu.mesh_decode --batches 1 64 --out "$OUT/mesh_2.json"
for f in "$OUT"/mesh_*.json; do
    python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[1].rsplit('/',1)[1], [(r['batch'], r['throughput_tok_s'], r['decode_tok_s_per_request_median'], r['device_idle_fraction']) for r in d['runs']])" "$f"
done
python3 -c "import json; d=json.load(open('$OUT/transformers.json')); print('transformers', [(r['batch'], r.get('throughput_tok_s')) for r in d.get('transformers', [])])"
echo "=== session done, $((DEADLINE - $(date +%s)))s before the deadline"
