"""C++ libraries for the CPU side, built once per machine and loaded with ctypes.

A library is compiled with the system C++ compiler (`$CXX`, else g++) into
`<cache>/cpu_kernels/` (`<cache>`: the model cache), named by a hash of its source, the
compiler's version, the flags and the CPU's flags (so a changed source, compiler or machine gets
its own build). No compiler, or a build that fails: `load_library` raises KernelUnavailable with
the reason, and the caller keeps its Python path.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

log = logging.getLogger(__name__)


class KernelUnavailable(RuntimeError):
    """The kernel cannot be built or loaded on this machine (the message says why)."""


def default_cache_dir() -> Path:
    """The model cache (`MESHLLM_MODEL_CACHE_DIR`, the same default): in a container that is the
    model-cache volume, so a recreated container finds its libraries built."""
    if path := os.environ.get("MESHLLM_MODEL_CACHE_DIR"):
        return Path(path).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")).expanduser() / "meshllm"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return " ".join(sorted(line.split(":", 1)[1].split()))
    except OSError:
        pass
    return platform.machine()


def library_path(source: Path, compiler: str, flags: Sequence[str], cache_dir: Path) -> Path:
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, check=True
    ).stdout
    key = hashlib.sha256(source.read_bytes())
    for part in (version, _cpu_flags(), " ".join(flags)):
        key.update(part.encode())
    return cache_dir / "cpu_kernels" / f"{source.stem}-{key.hexdigest()[:16]}.so"


def _build(source: Path, compiler: str, flags: Sequence[str], target: Path) -> None:
    """Compile into a temporary file beside `target`, then rename: concurrent builders (test
    processes, workers) each finish with a whole library in place."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        done = subprocess.run(
            [compiler, *flags, str(source), "-o", tmp], capture_output=True, text=True
        )
        if done.returncode != 0:
            raise KernelUnavailable(f"{compiler} failed: {done.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        Path(tmp).unlink(missing_ok=True)


def load_library(
    source: Path, flags: Sequence[str], cache_dir: Path | None = None
) -> tuple[ctypes.CDLL, Path]:
    """(the library built from `source`, its path); KernelUnavailable says why not."""
    compiler = os.environ.get("CXX", "g++")
    if shutil.which(compiler) is None:
        raise KernelUnavailable(f"no C++ compiler ({compiler}; set CXX or install g++)")
    try:
        path = library_path(source, compiler, flags, cache_dir or default_cache_dir())
        if not path.exists():
            log.info("building %s: %s", source.name, path)
            _build(source, compiler, flags, path)
        return ctypes.CDLL(str(path)), path
    except (OSError, subprocess.CalledProcessError) as exc:
        raise KernelUnavailable(f"cannot build or load {source.name}: {exc}") from exc
