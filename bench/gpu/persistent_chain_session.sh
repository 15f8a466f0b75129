#!/usr/bin/env bash
# What a launch boundary costs a chain of batch-1 GEMVs, and what one persistent grid saves
# (issue #9, the batch-1 target: bench/gpu/persistent_chain.py), at two K-steps.
#
#   run(command="bash bench/gpu/persistent_chain_session.sh", carry=[".whl", ".redisbin"])
SESSION_SECONDS=${SESSION_SECONDS:-240}
source "$(dirname "$0")/session_env.sh"
[ -z "${DEEP:-}" ] && step chain-k256 90 python3 -m bench.gpu.persistent_chain --block-k 256
[ -z "${DEEP:-}" ] && step chain-k128 90 python3 -m bench.gpu.persistent_chain --block-k 128
# DEEP=1 (a second call): deeper pipelines, more bytes in flight per SM
if [ -n "${DEEP:-}" ]; then
    step chain-k256-s6 60 python3 -m bench.gpu.persistent_chain --block-k 256 --stages 6
    step chain-k256-s8 60 python3 -m bench.gpu.persistent_chain --block-k 256 --stages 8
    step chain-k512-s4 60 python3 -m bench.gpu.persistent_chain --block-k 512 --stages 4
fi
