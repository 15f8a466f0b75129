"""The warp-specialized one-row GEMV (meshllm_kernels/decode_chain/gemv_ws.py) is Gluon, which
Triton's interpreter does not run; its numbers are checked on the H200
(tests/gpu/test_gemv_ws_cuda.py). Here, on any machine, it is compiled for sm_90 with this Triton,
in each form the decode chain launches (Gluon's API moves between releases; the H200 has Triton 3.6,
CI a later one): the weight ring and x's buffer fit one SM's shared memory, the loader issues TMA
loads, and only a chained launch waits for its predecessor. The compiler runs in a child process:
this one has TRITON_INTERPRET set (tests/conftest.py), under which Gluon cannot compile."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SM90_SHARED_BYTES = 227 * 1024  # the most one block may use on Hopper

FORMS = [  # (shape, partials, gated, pdl): qkv, gate_up and down as the chain runs them
    ((6144, 4096), True, False, True),
    ((28672, 4096), False, False, True),
    ((4096, 14336), True, True, True),
    ((4096, 4096), True, False, False),
]


def compile_form(shape: tuple[int, int], partials: bool, gated: bool, pdl: bool) -> dict:
    """(In the child) the kernel compiled for sm_90: its shared memory, PTX and settings."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    from meshllm_kernels.decode_chain import gemv_ws
    from meshllm_kernels.decode_chain.gemv import WS_CONFIGS
    from meshllm_kernels.runtime.tensor_checks import next_power_of_2

    cfg = WS_CONFIGS[shape]
    layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)
    steps = shape[1] // (cfg.split_k * cfg.block_k)
    signature = {
        "x_ptr": "*bf16",
        "w_desc": f"tensordesc<bf16[{cfg.block_n}, {cfg.block_k}],{layout!r}>",
        "out_ptr": "*fp32" if partials else "*bf16",
        **dict.fromkeys(("n_units", "split", "steps", "N", "K"), "i32"),
        **dict.fromkeys(
            ("USE_PARTIALS", "GATED", "PDL", "STAGES", "X_STEPS", "num_warps"), "constexpr"
        ),
    }
    constants = {
        "USE_PARTIALS": partials,
        "GATED": gated,
        "PDL": pdl,
        "STAGES": cfg.num_stages,
        "X_STEPS": next_power_of_2(steps),
        "num_warps": gemv_ws.COMPUTE_WARPS,
    }
    aligned = [["tt.divisibility", 16]]
    attrs = {(0,): aligned, (2,): aligned, (6,): aligned, (7,): aligned}
    source = GluonASTSource(gemv_ws._gemv_ws_kernel, signature, constants, attrs)
    options = {"num_warps": gemv_ws.COMPUTE_WARPS, "maxnreg": gemv_ws.MAX_REGISTERS}
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    ring = cfg.num_stages * cfg.block_n * cfg.block_k * 2
    return {
        "shared": kernel.metadata.shared,
        "ring": ring,
        "ptx": kernel.asm["ptx"],
        "maxnreg": gemv_ws.MAX_REGISTERS,
    }


def compiled(shape: tuple[int, int], partials: bool, gated: bool, pdl: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    form = json.dumps([list(shape), partials, gated, pdl])
    child = subprocess.run(
        [sys.executable, __file__, form], env=env, cwd=ROOT, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert child.returncode == 0, child.stderr[-4000:]
    result: dict = json.loads(child.stdout.splitlines()[-1])
    return result


@pytest.mark.parametrize(("shape", "partials", "gated", "pdl"), FORMS)
def test_compiles_for_hopper(
    shape: tuple[int, int], partials: bool, gated: bool, pdl: bool
) -> None:
    kernel = compiled(shape, partials, gated, pdl)
    assert kernel["ring"] <= kernel["shared"] <= SM90_SHARED_BYTES
    ptx = kernel["ptx"]
    assert "cp.async.bulk.tensor" in ptx  # the loader's TMA
    assert ("griddepcontrol.wait" in ptx) == pdl
    assert f".maxnreg {kernel['maxnreg']}" in ptx


if __name__ == "__main__":  # the child: compile one form, print it as JSON
    shape, partials, gated, pdl = json.loads(sys.argv[1])
    print(json.dumps(compile_form(tuple(shape), partials, gated, pdl)))
