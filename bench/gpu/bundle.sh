#!/usr/bin/env bash
# Build the offline bundle a GPU machine without network needs to run the GPU tests and
# benchmarks (`make gpu-bundle`; bench/gpu/run.sh installs and uses it there). The folders are
# git-ignored and travel with the tree:
#   .whl/       cp312 manylinux x86_64 wheels of what the GPU image lacks (the service stack:
#               fastapi, uvicorn, uvloop, httptools, pydantic(-core, -settings), redis-py,
#               hiredis, msgpack, jsonschema, prometheus-client, httpx, openai, xgrammar) and
#               their dependencies,
#               pinned to this venv's versions (the ones CI tests). The image's own torch,
#               triton, transformers, numpy, tokenizers, safetensors, huggingface-hub stay out.
#   .tokenizer/ the embedded SmolLM2's tokenizer files and config.json (no weights): the
#               tokenizer of bench/gpu/gateway_serve.py's random-weight model.
#   .redisbin/  redis-server with the shared libraries it links (found with ldd), but for
#               glibc's own and the C++ runtime (libstdc++, libgcc_s: every machine with torch
#               has them; bookworm's would raise the glibc needed from 2.34 to 2.36), and a
#               `redis-server` wrapper that sets LD_LIBRARY_PATH.
# Checks before it succeeds: the wheel set resolves offline for CPython 3.12 (pip --dry-run
# --no-index), one version per project, xgrammar's requirements all in the bundle or the
# image, and the bundled redis-server starts with only the bundle's libraries and answers PING.
set -euo pipefail
VENV_PY=${VENV_PY:-.venv/bin/python}
WHL=${WHL:-.whl}
REDISBIN=${REDISBIN:-.redisbin}
TOKDIR=${TOKDIR:-.tokenizer}
PIP=("$VENV_PY" -m pip)

# Resolved with their dependencies; none of them needs a package the image has.
STACK=(fastapi uvicorn uvloop httptools pydantic pydantic-core pydantic-settings redis hiredis msgpack jsonschema
    prometheus-client httpx openai)
# Without dependencies: xgrammar's other requirements (torch, triton, transformers, numpy) are
# the image's, and pip would otherwise fetch a multi-GB torch.
# gguf: transformers reads the embedded SmolLM2's GGUF with it (bench/gpu/weights.sh).
NO_DEPS=(xgrammar apache-tvm-ffi gguf)
IMAGE=(torch triton transformers numpy tokenizers safetensors huggingface-hub pyyaml requests tqdm)
TARGET=(--only-binary=:all: --python-version 3.12 --implementation cp
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
    --platform manylinux1_x86_64)

pinned() {  # NAME... -> NAME==<version installed in this venv>
    "$VENV_PY" -c 'import importlib.metadata as m, sys
print(" ".join(f"{n}=={m.version(n)}" for n in sys.argv[1:]))' "$@"
}

echo "== wheels -> $WHL"
rm -rf "$WHL"
mkdir -p "$WHL"
# shellcheck disable=SC2046  # pinned() prints one word per requirement
"${PIP[@]}" download -q "${TARGET[@]}" -d "$WHL" $(pinned "${STACK[@]}")
# shellcheck disable=SC2046
"${PIP[@]}" download -q --no-deps "${TARGET[@]}" -d "$WHL" $(pinned "${NO_DEPS[@]}")

echo "== check: the wheels resolve offline for CPython 3.12"
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
# --target ignores what is installed here: every requirement must come from the bundle.
# shellcheck disable=SC2046
"${PIP[@]}" install -q --dry-run --no-index --find-links "$WHL" --target "$scratch/site" \
    "${TARGET[@]}" $(pinned "${STACK[@]}")
# shellcheck disable=SC2046
"${PIP[@]}" install -q --dry-run --no-index --no-deps --find-links "$WHL" \
    --target "$scratch/site" "${TARGET[@]}" $(pinned "${NO_DEPS[@]}")
"$VENV_PY" - "$WHL" "${IMAGE[@]}" <<'PY'
"""One wheel per project, and the no-deps wheels' requirements met by the bundle or image."""
import re
import sys
import zipfile
from pathlib import Path

from packaging.requirements import Requirement


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


wheels = sorted(Path(sys.argv[1]).glob("*.whl"))
projects: dict[str, list[str]] = {}
for wheel in wheels:
    projects.setdefault(norm(wheel.name.split("-")[0]), []).append(wheel.name)
twice = {p: w for p, w in projects.items() if len(w) > 1}
if twice:
    sys.exit(f"more than one version of a project: {twice}")
available = set(projects) | {norm(n) for n in sys.argv[2:]}
env = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
       "platform_machine": "x86_64", "platform_system": "Linux", "os_name": "posix",
       "implementation_name": "cpython", "platform_python_implementation": "CPython",
       "extra": ""}
missing = []
for wheel in wheels:
    with zipfile.ZipFile(wheel) as zf:
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        for line in zf.read(meta).decode().splitlines():
            if line.startswith("Requires-Dist:"):
                req = Requirement(line.split(":", 1)[1].strip())
                if (not req.marker or req.marker.evaluate(env)) and norm(req.name) not in available:
                    missing.append(f"{wheel.name}: {req}")
if missing:
    sys.exit("requirements neither bundled nor in the GPU image:\n" + "\n".join(missing))
print(f"{len(wheels)} wheels, one version each, every requirement met")
PY

echo "== tokenizer -> $TOKDIR"
src=$("$VENV_PY" -c 'from shared.config import ModelSettings
from shared.model.source import resolve_model
print(resolve_model("", ModelSettings().model_cache_dir).hf_dir)')
rm -rf "$TOKDIR"
mkdir -p "$TOKDIR"
for name in config.json tokenizer.json tokenizer_config.json special_tokens_map.json \
    chat_template.jinja generation_config.json; do
    if [ -e "$src/$name" ]; then cp "$src/$name" "$TOKDIR/"; fi
done
[ -e "$TOKDIR/tokenizer.json" ] || { echo "no tokenizer.json in $src" >&2; exit 1; }

echo "== redis-server -> $REDISBIN"
server=$(command -v redis-server) || { echo "redis-server not installed (make redis)" >&2; exit 1; }
rm -rf "$REDISBIN"
mkdir -p "$REDISBIN/bin" "$REDISBIN/lib"
cp -L "$server" "$REDISBIN/bin/redis-server"
ldd "$server" | awk '/=> \// {print $3}' | while read -r lib; do
    case $(basename "$lib") in
        libc.so.* | libm.so.* | libpthread.so.* | libdl.so.* | librt.so.* | ld-linux*) ;;
        libstdc++.so.* | libgcc_s.so.*) ;;
        *) cp -L "$lib" "$REDISBIN/lib/" ;;
    esac
done
cat >"$REDISBIN/redis-server" <<'SH'
#!/bin/sh
# The bundled redis-server with the libraries copied beside it (bench/gpu/bundle.sh).
here=$(dirname "$(readlink -f "$0")")
LD_LIBRARY_PATH="$here/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "$here/bin/redis-server" "$@"
SH
chmod +x "$REDISBIN/redis-server"

echo "== check: redis-server runs from the bundle"
bundle_lib=$(cd "$REDISBIN/lib" && pwd)
outside=$(LD_LIBRARY_PATH=$bundle_lib ldd "$REDISBIN/bin/redis-server" |
    awk '/not found/ {print; next} /=> \// {print $3}' |
    grep -v -e "^$bundle_lib/" -e '/libc\.so' -e '/libm\.so' -e '/libpthread\.so' \
        -e '/libdl\.so' -e '/librt\.so' -e '/ld-linux' -e '/libstdc++\.so' -e '/libgcc_s\.so' ||
        true)
if [ -n "$outside" ]; then
    echo "libraries not taken from the bundle: $outside" >&2
    exit 1
fi
glibc=$(objdump -T "$REDISBIN/bin/redis-server" "$REDISBIN"/lib/* 2>/dev/null |
    awk '/\*UND\*/' | grep -o 'GLIBC_[0-9.]*' | sort -uV | tail -1 || true)
port=$("$VENV_PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
"$REDISBIN/redis-server" --bind 127.0.0.1 --port "$port" --save '' --appendonly no \
    --logfile "$scratch/redis.log" &
redis_pid=$!
"$VENV_PY" - "$port" <<'PY'
import sys
import time

import redis

client = redis.Redis(port=int(sys.argv[1]))
for _ in range(50):
    try:
        if client.ping():
            break
    except redis.ConnectionError:
        time.sleep(0.1)
else:
    sys.exit("the bundled redis-server did not answer PING")
PY
kill "$redis_pid"
wait "$redis_pid" 2>/dev/null || true
"$REDISBIN/redis-server" --version
echo "needs glibc >= ${glibc#GLIBC_} on the GPU machine"
du -sh "$WHL" "$REDISBIN" "$TOKDIR"
