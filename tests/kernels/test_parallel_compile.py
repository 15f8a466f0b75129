"""meshllm_kernels/parallel_compile.py without a GPU: inside a pool of more than one thread a
Triton launch only compiles (the JIT's run is replaced by one that asks for warmup), and the
JIT is itself again on leaving, also when the body raises; one thread changes nothing;
`precompiled` runs the launches in the pool, then for real. What
the pool compiles on a GPU is tests/gpu/test_parallel_compile_cuda.py's."""

from __future__ import annotations

import inspect

import pytest
from triton.runtime.jit import JITFunction

from meshllm_kernels.parallel_compile import compiles_in_parallel, default_threads, precompiled


def test_one_thread_leaves_launches_as_they_are() -> None:
    run = JITFunction.run
    with compiles_in_parallel(1) as pooled:
        assert pooled is False
        assert JITFunction.run is run


def test_a_pool_makes_launches_compile_only_until_it_is_left() -> None:
    run = JITFunction.run
    with compiles_in_parallel(4) as pooled:
        assert pooled is True
        assert JITFunction.run is not run
        # Same keywords as the JIT's own run, so every launch site still binds.
        assert inspect.signature(JITFunction.run).parameters.keys() == (
            inspect.signature(run).parameters.keys()
        )
    assert JITFunction.run is run
    with pytest.raises(RuntimeError), compiles_in_parallel(4):
        raise RuntimeError("a launch failed")
    assert JITFunction.run is run


def test_the_default_pool_fits_the_cpus_this_process_may_use() -> None:
    assert 1 <= default_threads() <= 16


def test_precompiled_launches_once_in_the_pool_then_for_real() -> None:
    run = JITFunction.run
    calls: list[bool] = []  # per call of the launches: whether Triton launches only compiled

    def launches() -> int:
        calls.append(JITFunction.run is not run)
        return len(calls)

    assert precompiled(launches, threads=4) == (2, True)
    assert calls == [True, False]
    calls.clear()
    assert precompiled(launches, threads=1) == (1, False)
    assert calls == [False]
