#!/usr/bin/env bash
# One device call (issue #9, batch-1 decode step): paged decode attention at the e2e
# benchmark's short contexts (batch 1-2, 512-4096 keys), old kernel vs the strided kernel with
# the fused merge at fixed split counts (bench/gpu/decode_variants.py --short).
#
#   run(command="bash bench/gpu/decode_short_session.sh", carry=[".whl", ".redisbin"])
source "$(dirname "$0")/session_env.sh"

step decode-short 200 python3 bench/gpu/decode_variants.py --short --out "$OUT/decode_short.json"
echo "=== session done, $((DEADLINE - $(date +%s)))s before the deadline"
