"""mamba_decode_step (Triton) against its PyTorch reference: y, the written slots, untouched
slots, in-place slots, pad rows, a chain of steps against one prefill, input errors."""

from __future__ import annotations

import pytest
import torch

from meshllm_kernels.mamba.cases import random_batch, random_params, random_pools
from meshllm_kernels.mamba.decode_step import mamba_decode_step
from meshllm_kernels.mamba.reference import mamba_decode_step_reference, mamba_prefill_reference

SHAPES = dict(n_heads=6, head_dim=3, n_groups=2, d_state=5, d_conv=4)
# (model dtype, conv pool dtype, ssm pool dtype, atol/rtol of y and the ssm state)
CONFIGS = [
    (torch.float32, torch.float32, torch.float32, 1e-5),
    (torch.bfloat16, torch.bfloat16, torch.float32, 2e-2),
    (torch.bfloat16, torch.bfloat16, torch.bfloat16, 2e-2),
    (torch.float16, torch.float32, torch.float16, 5e-3),
]


def assert_pools(got, want, orig, written, tol):
    """Written slots match the reference; every other slot is bit-identical to before."""
    for name, g, w, o in zip(("conv", "ssm"), got, want, orig, strict=True):
        t = 0 if name == "conv" else tol
        for slot in range(o.shape[0]):
            if slot in written:
                where = f"{name} slot {slot}"
                torch.testing.assert_close(
                    g[slot].float(), w[slot].float(), atol=t, rtol=t, msg=lambda m, w=where: w + m
                )
            else:
                assert torch.equal(g[slot], o[slot]), f"{name} slot {slot} was touched"


@pytest.mark.parametrize("dtype,conv_dtype,ssm_dtype,tol", CONFIGS)
def test_decode_step_matches_reference(device, dtype, conv_dtype, ssm_dtype, tol):
    p = random_params(**SHAPES, dtype=dtype, device=device, dt_limit=(0.0, 0.9))
    conv, ssm = random_pools(p, 10, conv_dtype, ssm_dtype)
    # row 0 in place, row 1 from zeros, row 2 to another slot, row 3 a pad row
    batch = random_batch(p, [1, 1, 1, 1], reads=[3, -1, 5, -1], writes=[3, 7, 8, -1], dtype=dtype)
    got, want = (conv.clone(), ssm.clone()), (conv.clone(), ssm.clone())
    args = (batch.xBC, batch.dt, p)
    y = mamba_decode_step(*args, *got, batch.read_slot, batch.write_slot)
    y_ref = mamba_decode_step_reference(*args, *want, batch.read_slot, batch.write_slot)
    assert y.shape == (4, 6, 3) and y.dtype == dtype
    torch.testing.assert_close(y.float(), y_ref.float(), atol=tol, rtol=tol)
    assert_pools(got, want, (conv, ssm), {3, 7, 8}, tol)
    assert not torch.equal(got[1][3], ssm[3]) and not torch.equal(got[0][3], conv[3])


def test_pool_check_catches_a_perturbed_slot(device):
    p = random_params(**SHAPES, device=device)
    conv, ssm = random_pools(p, 6, torch.float32, torch.float32)
    batch = random_batch(p, [1, 1], reads=[1, -1], writes=[1, 4])
    got, want = (conv.clone(), ssm.clone()), (conv.clone(), ssm.clone())
    mamba_decode_step(batch.xBC, batch.dt, p, *got, batch.read_slot, batch.write_slot)
    mamba_decode_step_reference(batch.xBC, batch.dt, p, *want, batch.read_slot, batch.write_slot)
    assert_pools(got, want, (conv, ssm), {1, 4}, 1e-5)
    for pool, slot in ((0, 4), (1, 1), (1, 2)):
        bad = [got[0].clone(), got[1].clone()]
        bad[pool][slot].view(-1)[0] += 0.01
        with pytest.raises(AssertionError):
            assert_pools(bad, want, (conv, ssm), {1, 4}, 1e-5)


def test_decode_chain_equals_prefill(device):
    """Three decode steps through slots 0 -> 1 -> 1 -> 2 (int64 slots) give the y and states of
    one prefill."""
    p = random_params(**SHAPES, device=device)
    conv, ssm = random_pools(p, 4, torch.float32, torch.float32)
    batch = random_batch(p, [3], reads=[0], writes=[3])
    got = (conv.clone(), ssm.clone())
    ys = []
    for t, (r, w) in enumerate([(0, 1), (1, 1), (1, 2)]):
        slots = [torch.tensor([s], dtype=torch.int64, device=device) for s in (r, w)]
        ys.append(mamba_decode_step(batch.xBC[t : t + 1], batch.dt[t : t + 1], p, *got, *slots))
    want = (conv.clone(), ssm.clone())
    y_ref = mamba_prefill_reference(batch.xBC, batch.dt, batch.cu_seqlens, p, *want,
                                    batch.read_slot, batch.write_slot)  # fmt: skip
    torch.testing.assert_close(torch.cat(ys), y_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[0][2], want[0][3], atol=0, rtol=0)
    torch.testing.assert_close(got[1][2], want[1][3], atol=1e-5, rtol=1e-5)


def test_decode_input_errors(device):
    p = random_params(**SHAPES, device=device)
    conv, ssm = random_pools(p, 4, torch.float32, torch.float32)
    b = random_batch(p, [1, 1], reads=[0, 1], writes=[2, 3])
    slots = (b.read_slot, b.write_slot)
    with pytest.raises(ValueError, match="xBC"):
        mamba_decode_step(b.xBC[:, :-1], b.dt, p, conv, ssm, *slots)
    with pytest.raises(ValueError, match="ssm_state"):
        mamba_decode_step(b.xBC, b.dt, p, conv, ssm[:, :, :, :-1], *slots)
    with pytest.raises(TypeError, match="read_slot"):
        mamba_decode_step(b.xBC, b.dt, p, conv, ssm, b.read_slot.float(), b.write_slot)
    with pytest.raises(ValueError, match="write_slot"):
        mamba_decode_step(b.xBC, b.dt, p, conv, ssm, b.read_slot, b.write_slot[:1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_decode_step_in_a_cuda_graph():
    p = random_params(**SHAPES, device="cuda")
    conv, ssm = random_pools(p, 6, torch.float32, torch.float32)
    b = random_batch(p, [1, 1, 1], reads=[0, 1, -1], writes=[0, 4, -1])
    want = (conv.clone(), ssm.clone())
    y_ref = mamba_decode_step_reference(b.xBC, b.dt, p, *want, b.read_slot, b.write_slot)
    mamba_decode_step(b.xBC, b.dt, p, conv.clone(), ssm.clone(), b.read_slot, b.write_slot)
    graph = torch.cuda.CUDAGraph()
    got = (conv.clone(), ssm.clone())
    with torch.cuda.graph(graph):
        y = mamba_decode_step(b.xBC, b.dt, p, *got, b.read_slot, b.write_slot)
    got[0].copy_(conv)
    got[1].copy_(ssm)
    graph.replay()
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
    assert_pools(got, want, (conv, ssm), {0, 4}, 1e-5)
