#!/usr/bin/env bash
# The Docker tests' images built in the background while `make test` runs the Python suites, so
# docker-test and swarm-test find them built. On a fresh machine the build (debootstrap, torch
# and the requirements in the image) took 178 s here, mostly downloads and unpacking.
#   start  returns at once. In the background, under a lock: the private dockerd started when
#          none answers (infra/docker/dockerd.sh), the images built (build_images.sh), and that
#          daemon stopped again if it was started here; the layers stay in its data-root. The
#          output goes to $RUN_DIR/build-ahead.log. A second start while one runs does nothing.
#   wait   blocks until a background build is done. docker_test.sh and swarm_test.sh call it
#          first, so they never start or stop the daemon under a build.
# A failed background build fails nothing here: docker-test builds again and fails there, with
# the build's own message.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

RUN_DIR=${MESHLLM_DOCKER_RUN_DIR:-/run/meshllm-docker}
LOCK=$RUN_DIR/build-ahead.lock

build() {
    # fd 9 holds the lock; the daemon must not inherit it, or the lock would outlive the build
    set +e
    SECONDS=0
    local owned=0
    infra/docker/dockerd.sh running 9>&- || owned=1
    infra/docker/dockerd.sh start 9>&- &&
        eval "$(infra/docker/dockerd.sh env)" &&
        infra/docker/build_images.sh 9>&-
    local status=$?
    [ "$owned" = 1 ] && infra/docker/dockerd.sh stop 9>&-
    echo "[build_ahead.sh] exit $status (${SECONDS} s)"
}

case "${1:-}" in
    start)
        mkdir -p "$RUN_DIR"
        exec 9>"$LOCK"
        flock -n 9 || exit 0 # a build is under way already
        build >"$RUN_DIR/build-ahead.log" 2>&1 </dev/null &
        ;;
    wait)
        [ -e "$LOCK" ] || exit 0
        flock "$LOCK" true
        ;;
    *)
        echo "usage: $0 start|wait" >&2
        exit 2
        ;;
esac
