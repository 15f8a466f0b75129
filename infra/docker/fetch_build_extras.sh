#!/usr/bin/env bash
# Fill .build-extras/ (git-ignored, sent to `docker build`) for a restricted network:
#   ca.crt   the CA bundle pip trusts on this host (pip's `cert` setting, else PIP_CERT)
#   wheels/  the CPU torch wheel, `pip download`ed on the host (where pip may find it on disk)
# Idempotent: the wheel is fetched only when missing. Prints the build args to use.
set -euo pipefail
VENV_PY=${VENV_PY:-.venv/bin/python}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
OUT=${BUILD_EXTRAS:-.build-extras}
mkdir -p "$OUT/wheels"

cert=$("$VENV_PY" -m pip config get global.cert 2>/dev/null || true)
cert=${cert:-${PIP_CERT:-}}
args=()
if [ -n "$cert" ] && [ -f "$cert" ]; then
    cmp -s "$cert" "$OUT/ca.crt" || cp "$cert" "$OUT/ca.crt"
    args+=(--build-arg PIP_CERT_FILE=ca.crt)
fi
if ! ls "$OUT"/wheels/torch-*.whl >/dev/null 2>&1; then
    "$VENV_PY" -m pip download "$TORCH_SPEC" --no-deps --only-binary=:all: \
        --python-version 3.11 --platform manylinux_2_28_x86_64 -d "$OUT/wheels" >&2
fi
case "$(ls "$OUT"/wheels/torch-*.whl)" in
    *+cpu*) args+=(--build-arg PIP_WHEEL_DIR=wheels --build-arg TORCH_INDEX=) ;;
    *) echo "warning: the fetched torch wheel is not a CPU build" >&2
       args+=(--build-arg PIP_WHEEL_DIR=wheels) ;;
esac
echo "${args[@]}"
