"""The watch on Triton compiles (meshllm_kernels/runtime/compile_watch.py) and the worker's
record of them (services/worker/runner/compile_stalls.py). Triton compiles nothing on a CPU,
so the hooks are called here as Triton's JITFunction._do_compile calls them (keyword
arguments, the pre-compile hook's answer deciding whether to compile); the real compile path is
tests/gpu/test_compile_watch_cuda.py."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import REGISTRY

from meshllm_kernels.runtime import compile_watch
from meshllm_kernels.runtime.compile_watch import CompileWatch
from services.worker.runner.compile_stalls import watch_compiles


def slots() -> tuple[Any, str, str]:
    found = compile_watch._hook_slots()
    assert found is not None, "this Triton has neither knobs nor JITFunction compile hooks"
    return found


def compile_once(kernel: str, constants: dict[Any, Any]) -> bool:
    """What Triton does around one compile; True when the pre-compile hook skipped it."""
    holder, pre, post = slots()
    kwargs = {
        "key": ("key",),
        "repr": f"{kernel}[num_warps=4](x: *fp32)",
        "fn": SimpleNamespace(name=kernel),
        "compile": {"constants": constants, "configs": [{(1,): [["tt.divisibility", 16]]}]},
        "is_manual_warmup": False,
        "already_compiled": False,
    }
    hook = getattr(holder, pre)
    if hook is not None and hook(**kwargs):
        return True
    after = getattr(holder, post)
    if after is not None:
        after(**kwargs)
    return False


@pytest.fixture
def watch() -> Any:
    w = CompileWatch().install()
    yield w
    w.uninstall()


def test_compiles_before_and_after_the_warmup_are_told_apart(watch: CompileWatch) -> None:
    assert not compile_once("_decode_kernel", {(5,): 64})
    watch.mark_warm()
    assert not compile_once("_merge_kernel", {(3,): 8})
    assert [c.kernel for c in watch.compiles] == ["_decode_kernel", "_merge_kernel"]
    assert [c.kernel for c in watch.after_warmup()] == ["_merge_kernel"]
    assert "8" in watch.after_warmup()[0].specialization
    assert all(c.seconds >= 0 for c in watch.compiles)


def test_a_hook_already_installed_is_chained_and_restored() -> None:
    holder, pre, post = slots()
    seen: list[str] = []
    before = getattr(holder, pre), getattr(holder, post)
    setattr(holder, pre, lambda **kw: seen.append("pre") or True)  # skips the compile
    setattr(holder, post, lambda **kw: seen.append("post"))
    try:
        w = CompileWatch().install()
        # the earlier hook's answer still decides (here: skip), and it still sees the call
        assert compile_once("_k", {})
        assert seen == ["pre"]
        w.uninstall()
        assert getattr(holder, pre) is not None and getattr(holder, pre) is not w._before
    finally:
        setattr(holder, pre, before[0])
        setattr(holder, post, before[1])


def sample(name: str, phase: str) -> float:
    return REGISTRY.get_sample_value(name, {"phase": phase}) or 0.0


def test_the_worker_logs_and_counts_a_serving_stall(caplog: pytest.LogCaptureFixture) -> None:
    total = "meshllm:worker_jit_compiles_total"
    warm0, serving0 = sample(total, "warmup"), sample(total, "serving")
    w = watch_compiles()
    try:
        with caplog.at_level(logging.WARNING):
            compile_once("_prefill_kernel", {(2,): 128})
            assert not caplog.records  # a warm-up compile is expected: not logged
            w.mark_warm()
            compile_once("_prefill_kernel", {(2,): 256})
    finally:
        w.uninstall()
    assert sample(total, "warmup") == warm0 + 1
    assert sample(total, "serving") == serving0 + 1
    assert len(caplog.records) == 1
    assert "_prefill_kernel" in caplog.records[0].getMessage()
    assert "256" in caplog.records[0].getMessage()
