"""A real Triton compile on CUDA reaches the compile watch
(meshllm_kernels/runtime/compile_watch.py): one compile per new specialization, none for a
launch that reuses one."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from meshllm_kernels.runtime.compile_watch import CompileWatch


@triton.jit
def _scaled_copy(x_ptr, out_ptr, n, SCALE: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask) * SCALE, mask=mask)


def test_a_new_specialization_is_one_compile_after_the_warmup() -> None:
    x = torch.arange(100, device="cuda", dtype=torch.float32)
    out = torch.empty_like(x)
    watch = CompileWatch().install()
    try:
        _scaled_copy[(1,)](x, out, 100, SCALE=2, BLOCK=128)
        watch.mark_warm()
        _scaled_copy[(1,)](x, out, 100, SCALE=2, BLOCK=128)  # cached: no compile
        assert watch.after_warmup() == []
        _scaled_copy[(1,)](x, out, 100, SCALE=3, BLOCK=128)  # a new constexpr
        torch.cuda.synchronize()
    finally:
        watch.uninstall()
    assert torch.equal(out, x * 3)
    stalls = watch.after_warmup()
    assert [c.kernel for c in stalls] == ["_scaled_copy"]
    assert stalls[0].seconds > 0
    assert len(watch.compiles) == 2
