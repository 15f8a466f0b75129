# Sourced by infra/Dockerfile before each pip install: turns the optional build extras
# (build args PIP_CERT_FILE, PIP_WHEEL_DIR; files copied to /tmp/build-extras) into pip's
# environment. Both empty (the default): pip uses its normal CA store and PyPI only.
if [ -n "${PIP_CERT_FILE:-}" ]; then
    [ -f "/tmp/build-extras/$PIP_CERT_FILE" ] || { echo "no .build-extras/$PIP_CERT_FILE" >&2; exit 1; }
    export PIP_CERT="/tmp/build-extras/$PIP_CERT_FILE"
fi
if [ -n "${PIP_WHEEL_DIR:-}" ]; then
    [ -d "/tmp/build-extras/$PIP_WHEEL_DIR" ] || { echo "no .build-extras/$PIP_WHEEL_DIR/" >&2; exit 1; }
    export PIP_FIND_LINKS="/tmp/build-extras/$PIP_WHEEL_DIR"
fi
