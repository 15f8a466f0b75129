#!/usr/bin/env bash
# One device call (issue #9, batch-1 decode): kernels over a bf16 cache take one shared 1.0 scale
# tensor (kernels/attention/paged_cache.py unit_scale) instead of a fresh torch.ones per call (two fills a
# layer inside the decode graph). GPU tests, then the mesh at batch 1 and 16 alternating between
# a copy of this tree that allocates per call again and this tree, three times.
#
#   run(command="bash bench/gpu/unit_scale_session.sh", carry=[".whl", ".redisbin"])
source "$(dirname "$0")/session_env.sh"

step gpu-tests 200 python3 -m pytest -q -x tests/gpu tests/kernels/test_unit_scale.py \
    tests/kernels/test_kv_insert.py tests/kernels/test_paged_decode.py
plain_copy
sed -i 's/    one = unit_scale(device)$/    one = torch.ones(1, dtype=torch.float32, device=device)/' \
    /tmp/plain/kernels/paged_cache.py
sed -i 's/        ks = vs = unit_scale(device)$/        ks = vs = torch.ones(1, dtype=torch.float32, device=device)/' \
    /tmp/plain/kernels/kv_insert.py
grep -n "torch.ones(1, dtype=torch.float32" /tmp/plain/kernels/paged_cache.py /tmp/plain/kernels/kv_insert.py
mesh_ab 3 plain shared
echo "=== session done, $((DEADLINE - $(date +%s)))s before the deadline"
