#!/usr/bin/env bash
# `make swarm-test`: the Swarm stack deployed for real on a one-node swarm, then torn down.
#   1. the private dockerd (infra/docker/dockerd.sh) and the images (infra/docker/
#      build_images.sh, shared with `make docker-test`; cached layers make this seconds then)
#   2. `docker swarm init` on that daemon, unless it is a swarm node already (left as found)
#   3. tests/swarm: pytest creates the secrets, renders and deploys the stack, serves through
#      the published gateway port, scales the worker groups 1 -> 2 -> 1 and rolls the workers
#      over under load, then removes the stack, its volumes and the secrets
# On exit, whatever happened: stack, volumes and secrets removed again, the swarm left if this
# run made it, the daemon stopped if this run started it; then no container of the stack runs.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

VENV=${VENV:-.venv}
export VENV VENV_PY=$VENV/bin/python
eval "$(infra/docker/dockerd.sh env)"
export MESHLLM_SWARM_STACK=${MESHLLM_SWARM_STACK:-meshllm-swarm-test}
STACK=$MESHLLM_SWARM_STACK
log() { echo "[swarm-test] $*" >&2; }

infra/docker/build_ahead.sh wait  # `make test` may be building the images
owned=0
infra/docker/dockerd.sh running || owned=1
made_swarm=0

stack_containers() { docker ps -aq --filter "label=com.docker.stack.namespace=$STACK"; }

cleanup() {
    status=$?
    if infra/docker/dockerd.sh running; then
        docker stack rm "$STACK" >/dev/null 2>&1 || true
        for _ in $(seq 1 90); do [ -z "$(stack_containers)" ] && break; sleep 1; done
        left=$(stack_containers)
        if [ -n "$left" ]; then
            log "containers of $STACK still there after docker stack rm: $left"
            status=1
        fi
        docker volume ls -q | grep "^${STACK}_" | xargs -r docker volume rm >/dev/null 2>&1 || true
        "$VENV_PY" -m infra.swarm.secrets remove >/dev/null 2>&1 || true
        [ "$made_swarm" = 1 ] && docker swarm leave --force >/dev/null 2>&1
        docker image prune -f >/dev/null 2>&1 || true
    fi
    [ "$owned" = 1 ] && infra/docker/dockerd.sh stop
    log "done (${SECONDS} s, exit $status)"
    exit "$status"
}
trap cleanup EXIT

SECONDS=0
infra/docker/dockerd.sh start
infra/docker/build_images.sh  # test.env's image
if [ "$(docker info --format '{{.Swarm.LocalNodeState}}')" != active ]; then
    docker swarm init --advertise-addr 127.0.0.1 >/dev/null
    made_swarm=1
    log "one-node swarm initialised (${SECONDS} s)"
fi

MESHLLM_SWARM_TEST=1 "$VENV/bin/pytest" -q -rA --durations=5 -p no:cacheprovider tests/swarm "$@"
