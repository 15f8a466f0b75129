"""mamba_prefill (Triton) against its PyTorch reference: packed requests of lengths 1, not
multiples of the chunk size, and empty; in-place slots; pad requests; boundary states equal to
the states of runs cut there, and runs resumed from them."""

from __future__ import annotations

import pytest
import torch

from meshllm_kernels.mamba.cases import random_batch, random_params, random_pools
from meshllm_kernels.mamba.prefill import mamba_prefill
from meshllm_kernels.mamba.reference import mamba_prefill_reference
from tests.kernels.test_mamba_decode import CONFIGS, assert_pools

SHAPES = dict(n_heads=4, head_dim=3, n_groups=2, d_state=5, d_conv=4)
NUM_BLOCKS = 16


# chunk_size of mamba_prefill: None is the sequential scan, 16 the chunked SSD (its minimum)
SCANS = [None, 16]


def run(fn, batch, p, pools, **kw):
    bounds = (batch.state_cu, batch.state_offsets, batch.state_slots)
    return fn(batch.xBC, batch.dt, batch.cu_seqlens, p, *pools, batch.read_slot,
              batch.write_slot, *bounds, **kw)  # fmt: skip


def mixed_batch(p, dtype):
    """5 requests: length 1 in place; 7 from zeros with 2 boundaries (one inside the initial
    conv window); 37 in place (3 chunks of 16, the last partial) with boundaries inside the
    first and second chunk and at its end; an empty span; a pad request."""
    return random_batch(
        p, [1, 7, 37, 0, 3],
        reads=[3, -1, 5, 6, -1], writes=[3, 7, 5, 9, -1],
        bounds=[[], [(2, 10), (5, 11)], [(4, 12), (20, 13), (37, 14)], [], []],
        dtype=dtype,
    )  # fmt: skip


@pytest.mark.parametrize("chunk_size", SCANS)
@pytest.mark.parametrize("dtype,conv_dtype,ssm_dtype,tol", CONFIGS)
def test_prefill_matches_reference(device, dtype, conv_dtype, ssm_dtype, tol, chunk_size):
    p = random_params(**SHAPES, dtype=dtype, device=device, conv_bias=dtype != torch.float16)
    conv, ssm = random_pools(p, NUM_BLOCKS, conv_dtype, ssm_dtype)
    batch = mixed_batch(p, dtype)
    got, want = (conv.clone(), ssm.clone()), (conv.clone(), ssm.clone())
    y = run(mamba_prefill, batch, p, got, chunk_size=chunk_size)
    y_ref = run(mamba_prefill_reference, batch, p, want)
    assert y.shape == (48, 4, 3) and y.dtype == dtype
    torch.testing.assert_close(y.float(), y_ref.float(), atol=tol, rtol=tol)
    # the empty span writes its (unchanged) read state to slot 9; the pad request nothing
    assert_pools(got, want, (conv, ssm), {3, 5, 7, 9, 10, 11, 12, 13, 14}, tol)
    torch.testing.assert_close(got[1][9], ssm[6], atol=0, rtol=0)


@pytest.mark.parametrize("chunk_size", SCANS)
def test_boundaries_are_cut_runs_and_resume(device, chunk_size):
    """Each boundary state equals the final state of a run over just that prefix, and a run
    resumed from it reproduces the rest of the full run's y and final state."""
    p = random_params(**SHAPES, device=device)
    conv, ssm = random_pools(p, NUM_BLOCKS, torch.float32, torch.float32)
    n = 41
    full = random_batch(p, [n], reads=[2], writes=[15], bounds=[[(1, 4), (6, 5), (32, 6)]])
    pools = (conv.clone(), ssm.clone())
    y = run(mamba_prefill, full, p, pools, chunk_size=chunk_size)
    for o, slot in ((1, 4), (6, 5), (32, 6)):
        cut = (conv.clone(), ssm.clone())
        head = random_batch(p, [o], reads=[2], writes=[slot])
        y_head = mamba_prefill(full.xBC[:o], full.dt[:o], head.cu_seqlens, p, *cut,
                               head.read_slot, head.write_slot, chunk_size=chunk_size)  # fmt: skip
        torch.testing.assert_close(y_head, y[:o], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(pools[0][slot], cut[0][slot], atol=0, rtol=0)
        torch.testing.assert_close(pools[1][slot], cut[1][slot], atol=1e-5, rtol=1e-5)
        tail = random_batch(p, [n - o], reads=[slot], writes=[0])
        y_tail = mamba_prefill(full.xBC[o:], full.dt[o:], tail.cu_seqlens, p, *cut,
                               tail.read_slot, tail.write_slot, chunk_size=chunk_size)  # fmt: skip
        torch.testing.assert_close(y_tail, y[o:], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(cut[0][0], pools[0][15], atol=0, rtol=0)
        torch.testing.assert_close(cut[1][0], pools[1][15], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("chunk_size", SCANS)
def test_pad_requests_touch_nothing(device, chunk_size):
    p = random_params(**SHAPES, device=device)
    conv, ssm = random_pools(p, NUM_BLOCKS, torch.float32, torch.float32)
    batch = random_batch(p, [3, 0, 2], reads=[-1, -1, 4], writes=[-1, -1, -1],
                         bounds=[[(1, -1)], [], [(1, -1)]])  # fmt: skip
    pools = (conv.clone(), ssm.clone())
    y = run(mamba_prefill, batch, p, pools, chunk_size=chunk_size)
    assert torch.equal(pools[0], conv) and torch.equal(pools[1], ssm)
    y_ref = run(mamba_prefill_reference, batch, p, (conv.clone(), ssm.clone()))
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)


def test_prefill_input_errors(device):
    p = random_params(**SHAPES, device=device)
    conv, ssm = random_pools(p, 4, torch.float32, torch.float32)
    b = random_batch(p, [2, 3], reads=[0, 1], writes=[2, 3], bounds=[[(1, 0)], []])
    with pytest.raises(TypeError, match="cu_seqlens"):
        mamba_prefill(b.xBC, b.dt, b.cu_seqlens.long(), p, conv, ssm, b.read_slot, b.write_slot)
    with pytest.raises(ValueError, match="go together"):
        mamba_prefill(b.xBC, b.dt, b.cu_seqlens, p, conv, ssm, b.read_slot, b.write_slot,
                      b.state_cu)  # fmt: skip
    with pytest.raises(ValueError, match="state_cu"):
        mamba_prefill(b.xBC, b.dt, b.cu_seqlens, p, conv, ssm, b.read_slot, b.write_slot,
                      b.state_cu[:-1], b.state_offsets, b.state_slots)  # fmt: skip
    with pytest.raises(ValueError, match="chunk_size"):
        mamba_prefill(b.xBC, b.dt, b.cu_seqlens, p, conv, ssm, b.read_slot, b.write_slot,
                      chunk_size=24)  # fmt: skip
    with pytest.raises(ValueError, match="dt"):
        mamba_prefill(b.xBC, b.dt[:, :-1], b.cu_seqlens, p, conv, ssm, b.read_slot, b.write_slot)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="model-sized shapes: GPU only")
@pytest.mark.parametrize("chunk_size", [None, 64])
@pytest.mark.parametrize(
    "dtype,ssm_dtype,tol",
    [(torch.float32, torch.float32, 2e-4), (torch.bfloat16, torch.float32, 3e-2)],
)
def test_prefill_model_shapes(dtype, ssm_dtype, tol, chunk_size):
    """Bamba-like heads (64 x 128 state, one group) over spans of several 64-token chunks."""
    p = random_params(8, 64, 1, 128, dtype=dtype, device="cuda")
    conv, ssm = random_pools(p, 8, dtype, ssm_dtype)
    batch = random_batch(p, [1, 100, 300], reads=[0, -1, 1], writes=[0, 2, 3],
                         bounds=[[], [(64, 4)], [(64, 5), (256, 6)]], dtype=dtype)  # fmt: skip
    got, want = (conv.clone(), ssm.clone()), (conv.clone(), ssm.clone())
    y = run(mamba_prefill, batch, p, got, chunk_size=chunk_size)
    y_ref = run(mamba_prefill_reference, batch, p, want, chunk_size=64)
    torch.testing.assert_close(y.float(), y_ref.float(), atol=tol, rtol=tol)
    assert_pools(got, want, (conv, ssm), {0, 2, 3, 4, 5, 6}, tol)
