#!/bin/sh
# Run by infra/Dockerfile in the runtime images: g++ (and gcc) and Python's headers, which the
# worker builds with at run time: Triton's kernel launchers (CUDA), the C++ CPU kernels and
# inductor's compiled forward (CPU; its kernels are Python extensions). python:*-slim has the
# headers; a Debian python3 base gets them from libpython3-dev. dpkg leaves out what no such
# build reads: docs, translations, the sanitizers' runtimes, static libpython.
set -eu
printf 'path-exclude %s\n' '/usr/share/doc/*' '/usr/share/man/*' '/usr/share/locale/*' \
    '/usr/lib/*san.so*' '/usr/lib/*san.a' '/usr/lib/*san_preinit.o' '/usr/lib/*/libpython3*.a' \
    >/etc/dpkg/dpkg.cfg.d/meshllm-slim
include=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
packages=g++
[ -e "$include/Python.h" ] || packages="$packages libpython3-dev"
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $packages >/dev/null
rm -rf /var/lib/apt/lists/*
