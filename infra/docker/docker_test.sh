#!/usr/bin/env bash
# `make docker-test`: the compose stack built and tested for real, then everything torn down.
#   1. a private dockerd (infra/docker/dockerd.sh), unless one already answers on its socket
#   2. the local base images (debootstrap; no registry is reachable) and the CPU image
#      (infra/docker/build_images.sh, shared with `make swarm-test`)
#   3. tests/docker (pytest brings the stack up with `docker compose up -d --wait` and takes
#      it down with `docker compose down -v`)
# On exit, whatever happened: `docker compose down -v` once more, and the daemon stopped if
# this run started it. Image layers stay in the daemon's data-root for the next run.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

VENV=${VENV:-.venv}
export VENV VENV_PY=$VENV/bin/python
eval "$(infra/docker/dockerd.sh env)"
PROJECT=meshllm-test
log() { echo "[docker-test] $*" >&2; }

infra/docker/build_ahead.sh wait  # `make test` may be building the images
owned=0
infra/docker/dockerd.sh running || owned=1

cleanup() {
    status=$?
    if infra/docker/dockerd.sh running; then
        docker compose -p "$PROJECT" -f docker-compose.yml -f docker-compose.test.yml \
            --env-file infra/docker/test.env down -v --timeout 10 >/dev/null 2>&1 || true
        docker image prune -f >/dev/null 2>&1 || true  # superseded layers of older builds
    fi
    [ "$owned" = 1 ] && infra/docker/dockerd.sh stop
    exit "$status"
}
trap cleanup EXIT

SECONDS=0
infra/docker/dockerd.sh start
infra/docker/build_images.sh  # test.env's image on the local base images

MESHLLM_DOCKER_TEST=1 "$VENV/bin/pytest" -q -rA --durations=5 -p no:cacheprovider tests/docker "$@"
log "done (${SECONDS} s)"
