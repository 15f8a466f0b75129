"""meshllm_kernels/runtime/cpu_library.py: C++ libraries built once per source, compiler, flags
and CPU, then loaded from the cache; a failed build is KernelUnavailable with the reason.

A one-function source keeps these builds to a fraction of a second (the decode-attention
kernel's own build takes tens of seconds on CPUs without AVX-512)."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest

from meshllm_kernels.runtime.cpu_library import KernelUnavailable, load_library

FLAGS = ("-O1", "-shared", "-fPIC")


def source(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "answer.cpp"
    path.write_text(f'extern "C" int meshllm_answer() {{ {body} }}\n')
    return path


def answer(library: ctypes.CDLL) -> int:
    library.meshllm_answer.restype = ctypes.c_int
    return library.meshllm_answer()


def test_build_is_cached_by_source_and_flags(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    code = source(tmp_path, "return 42;")
    library, path = load_library(code, FLAGS, cache)
    assert answer(library) == 42
    assert path.parent == cache / "cpu_kernels" and path.name.startswith("answer-")
    built = path.stat().st_mtime_ns

    _, again = load_library(code, FLAGS, cache)
    assert again == path and again.stat().st_mtime_ns == built  # not rebuilt

    _, other_flags = load_library(code, ("-O2", "-shared", "-fPIC"), cache)
    assert other_flags != path
    changed, changed_path = load_library(source(tmp_path, "return 7;"), FLAGS, cache)
    assert changed_path not in (path, other_flags) and answer(changed) == 7
    # only whole libraries in the cache: no temporary file of a build is left behind
    assert sorted(p.name for p in (cache / "cpu_kernels").iterdir()) == sorted(
        p.name for p in (path, other_flags, changed_path)
    )


def test_a_failed_build_says_why_and_leaves_nothing(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    with pytest.raises(KernelUnavailable, match=r"(?s)failed: .*not_declared_anywhere"):
        load_library(source(tmp_path, "return not_declared_anywhere;"), FLAGS, cache)
    assert list((cache / "cpu_kernels").iterdir()) == []


def test_without_a_compiler_the_caller_is_told(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("CXX", "no-such-compiler")
    with pytest.raises(KernelUnavailable, match="no C\\+\\+ compiler"):
        load_library(source(tmp_path, "return 1;"), FLAGS, tmp_path / "cache")


def test_libraries_live_in_the_model_cache(tmp_path: Path, monkeypatch) -> None:
    """A container's model cache is its volume: a recreated worker finds its libraries."""
    monkeypatch.setenv("MESHLLM_MODEL_CACHE_DIR", str(tmp_path / "volume"))
    _, path = load_library(source(tmp_path, "return 3;"), FLAGS)
    assert path.parent == tmp_path / "volume" / "cpu_kernels"
    monkeypatch.delenv("MESHLLM_MODEL_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    _, path = load_library(source(tmp_path, "return 4;"), FLAGS)
    assert path.parent == tmp_path / "xdg" / "meshllm" / "cpu_kernels"
