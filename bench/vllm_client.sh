#!/usr/bin/env bash
# vLLM's own benchmark client, `vllm bench serve`, without the rest of vLLM (`make vllm-client`).
# bench/vllm_client.py runs it against the gateway. The client is a pure HTTP client, but
# it ships only inside the vllm wheel (239 MB, mostly CUDA kernels), which no GPU call can
# carry (64 MiB) and which would bring a second torch. So this takes the pinned wheel's
# Python sources unchanged, leaves out its compiled extensions and kernel folders (the client
# never loads them; bench/vllm_client.py runs it with VLLM_TARGET_DEVICE=cpu, so vLLM picks
# no GPU platform), and adds the client's own requirements. Written under $DIR (ignored):
#   vllm-src.tar.gz  vllm/ and its dist-info as in the wheel, less *.so, vllm-rs/ and the third_party kernels
#                    deep_gemm/ and fmha_sm100/ (12 MB; 474 MB unpacked in full);
#   wheels/          the client's requirements the GPU image lacks, cp312 manylinux x86_64
#                    (bench/gpu/run.sh installs them there);
#   src/, site/      the sources unpacked and the requirements installed for this venv's
#                    Python: what bench/vllm_client.py uses by default here.
# Checks before it succeeds: `vllm bench serve --help` runs from src/ + site/ with this venv.
set -euo pipefail
VENV_PY=${VENV_PY:-.venv/bin/python}
DIR=${DIR:-.vllmclient}
CACHE=${CACHE:-$HOME/.cache/meshllm/wheels}
VLLM=vllm==0.34.0
# What `vllm bench serve` imports beyond torch, numpy, transformers, tokenizers, tqdm, pyyaml,
# requests, psutil, sentencepiece and pillow (the GPU image's) and the GPU bundle's .whl/
# (pydantic, fastapi, openai, msgpack, opentelemetry-api, uvloop, ...). Found by running it in a
# Python that had only those: each missing import, one at a time. uvloop came from here until the
# services ran on it (pyproject): the bundle's copy keeps a carry of the tree, .whl/, .redisbin/,
# .tokenizer/ and these two parts under the 64 MiB a GPU call carries.
REQUIRES=(aiohappyeyeballs==2.7.1 aiohttp==3.14.5 aiosignal==1.4.0 cachetools==8.0.3
    cbor2==6.3.0 cloudpickle==3.1.3 einops==0.8.2 frozenlist==1.8.0 llguidance==1.9.1
    msgspec==0.23.0 multidict==7.2.1 openai-harmony==0.0.8 orjson==3.13.0
    partial-json-parser==0.2.1.1.post7 propcache==0.5.4 py-cpuinfo==9.0.0 pybase64==1.5.1
    pyzmq==27.3.0 watchfiles==1.3.0 yarl==1.25.1 setuptools==84.2.1)
# Here only: the dev venv has no pillow (the GPU image has, with torchvision).
LOCAL_ONLY=(pillow==13.0.0)
TARGET=(--only-binary=:all: --python-version 3.12 --implementation cp
    --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
    --platform manylinux1_x86_64)

echo "== $VLLM wheel -> $CACHE"
mkdir -p "$CACHE"
"$VENV_PY" -m pip download -q --no-deps --only-binary=:all: -d "$CACHE" "$VLLM"
wheel=$(ls "$CACHE"/vllm-"${VLLM#vllm==}"-*.whl)

echo "== sources -> $DIR/vllm-src.tar.gz"
rm -rf "$DIR"
mkdir -p "$DIR/src"
"$VENV_PY" - "$wheel" "$DIR/src" <<'PY'
"""Unpack vllm/ and its metadata (the CLI asks for its version) from the wheel, less what only
a GPU engine loads."""
import sys
import zipfile

LEFT_OUT = ("vllm/vllm-rs", "vllm/third_party/deep_gemm/", "vllm/third_party/fmha_sm100/")
with zipfile.ZipFile(sys.argv[1]) as wheel:
    names = [
        n for n in wheel.namelist()
        if n.startswith(("vllm/", "vllm-")) and not n.endswith(".so") and not n.startswith(LEFT_OUT)
    ]  # fmt: skip
    wheel.extractall(sys.argv[2], names)
print(len(names), "files")
PY
tar -czf "$DIR/vllm-src.tar.gz" -C "$DIR/src" .

echo "== the client's requirements: $DIR/wheels (cp312), $DIR/site (this venv)"
"$VENV_PY" -m pip download -q --no-deps "${TARGET[@]}" -d "$DIR/wheels" "${REQUIRES[@]}"
"$VENV_PY" -m pip install -q --no-deps --no-compile --target "$DIR/site" \
    "${REQUIRES[@]}" "${LOCAL_ONLY[@]}"

echo "== check: vllm bench serve --help"
"$VENV_PY" -m bench.vllm_client --help >/dev/null
du -sh "$DIR/vllm-src.tar.gz" "$DIR/wheels"
touch "$DIR/.built"  # make's target: the whole build succeeded
