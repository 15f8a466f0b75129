#!/usr/bin/env bash
# Build the local base images the tests use in place of registry images (no registry is
# reachable here): NAME from a debootstrap'd Debian bookworm (python3 3.11, matching the
# cp311 torch wheel), and REDIS_NAME = NAME + redis-server from apt. Skipped when the image
# already exists in the engine (the data-root is kept between runs).
# usage: build_base.sh [NAME] [REDIS_NAME]
set -euo pipefail

NAME=${1:-meshllm-base:bookworm}
REDIS_NAME=${2:-meshllm-redis:bookworm}
MIRROR=${MESHLLM_DEBIAN_MIRROR:-http://deb.debian.org/debian}
log() { echo "[build_base.sh] $*" >&2; }

if ! docker image inspect "$NAME" >/dev/null 2>&1; then
    command -v debootstrap >/dev/null 2>&1 || {
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null
    }
    root=$(mktemp -d /tmp/meshllm-base.XXXXXX)
    trap 'rm -rf "$root"' EXIT
    log "debootstrap bookworm into $root"
    # passwd: useradd for the non-root user; the rest is what python:3.11-slim brings.
    debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates,passwd \
        bookworm "$root" "$MIRROR" >"$root.log" 2>&1 || { tail -n 30 "$root.log" >&2; exit 1; }
    rm -f "$root.log"
    rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
    # `python` as in the official python images, so Dockerfile lines work on either base.
    ln -sf python3 "$root/usr/bin/python"
    tar -C "$root" -c . | docker import \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'CMD ["python3"]' - "$NAME" >/dev/null
    log "imported $NAME"
fi

if ! docker image inspect "$REDIS_NAME" >/dev/null 2>&1; then
    log "building $REDIS_NAME"
    printf '%s\n' "FROM $NAME" \
        'RUN apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends redis-server >/dev/null && rm -rf /var/lib/apt/lists/*' \
        'USER redis' \
        'CMD ["redis-server"]' |
        docker build --network host -q -t "$REDIS_NAME" - >/dev/null
    log "built $REDIS_NAME"
fi
