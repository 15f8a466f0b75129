#!/usr/bin/env bash
# Build the images the Docker tests run, on the engine DOCKER_HOST names (no registry here):
#   1. the local base images (debootstrap; build_base.sh), skipped when present
#   2. the CPU image, with the host's CA bundle and the CPU torch wheel
#      (fetch_build_extras.sh), its dependency stage tagged so `docker image prune` keeps it
# Used by `make docker-test` (docker_test.sh), `make swarm-test` (swarm_test.sh) and `make test`
# ahead of them (build_ahead.sh).
# usage: build_images.sh [CPU_IMAGE] [BASE_IMAGE] [REDIS_IMAGE] (CPU_IMAGE: test.env's by default)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

CPU_IMAGE=${1:-$(sed -n 's/^MESHLLM_IMAGE_CPU=//p' infra/docker/test.env)}
BASE_IMAGE=${2:-${MESHLLM_DOCKER_BASE:-meshllm-base:bookworm}}
REDIS_IMAGE=${3:-${MESHLLM_DOCKER_REDIS:-meshllm-redis:bookworm}}
log() { echo "[build_images.sh] $*" >&2; }

SECONDS=0
infra/docker/build_base.sh "$BASE_IMAGE" "$REDIS_IMAGE"
log "base images ready (${SECONDS} s)"
read -r -a extras <<<"$(infra/docker/fetch_build_extras.sh)"
# The dependency stage is tagged so `docker image prune` (cleanup) keeps its layers: untagged,
# they are dangling and every run would reinstall torch and the requirements.
for target in cpu-deps cpu; do
    tag=$CPU_IMAGE; [ "$target" = cpu ] || tag=$CPU_IMAGE-$target
    docker build --network host -q -f infra/Dockerfile --target "$target" \
        --build-arg PYTHON_IMAGE="$BASE_IMAGE" "${extras[@]}" -t "$tag" . >/dev/null
done
log "image $CPU_IMAGE built (${SECONDS} s)"
docker image ls --format '{{.Repository}}:{{.Tag}}  {{.Size}}' |
    grep -E "^($CPU_IMAGE|$BASE_IMAGE|$REDIS_IMAGE) " >&2 || true
