#!/usr/bin/env bash
# What a launch boundary costs a chain of batch-1 GEMVs, and what one persistent grid saves
# (issue #9, the batch-1 target: bench/gpu/persistent_chain.py), at two K-steps.
#
#   run(command="bash bench/gpu/persistent_chain_session.sh", carry=[".whl", ".redisbin"])
SESSION_SECONDS=${SESSION_SECONDS:-240}
source "$(dirname "$0")/session_env.sh"
[ -z "${DEEP:-}" ] && step chain-k256 90 python3 -m bench.gpu.persistent_chain --block-k 256
[ -z "${DEEP:-}" ] && step chain-k128 90 python3 -m bench.gpu.persistent_chain --block-k 128
