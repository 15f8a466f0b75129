"""The Mamba2 references against a plain step-by-step recurrence and transformers' math."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers.models.bamba.modeling_bamba as mb

from meshllm_kernels.mamba.cases import random_batch, random_params, random_pools
from meshllm_kernels.mamba.reference import mamba_decode_step_reference, mamba_prefill_reference

# 3 heads in 1 group... 4 heads in 2 groups, non-power-of-2 head_dim / d_state.
SHAPES = dict(n_heads=4, head_dim=3, n_groups=2, d_state=5, d_conv=4)


def plain_recurrence(p, batch, conv_state, ssm_state):
    """Token by token, head by head, written out plainly (fp32)."""
    K = p.d_conv
    A = -torch.exp(p.A_log.float())
    cu = batch.cu_seqlens.tolist()
    scu = batch.state_cu.tolist()
    offs, slots = batch.state_offsets.tolist(), batch.state_slots.tolist()
    y = torch.zeros(batch.xBC.shape[0], p.n_heads, p.head_dim)
    writes = []
    for r in range(len(cu) - 1):
        read = int(batch.read_slot[r])
        window = [
            conv_state[read, :, j].float() if read >= 0 else torch.zeros(p.conv_dim)
            for j in range(K - 1)
        ]
        S = ssm_state[read].float().clone() if read >= 0 else torch.zeros(ssm_state.shape[1:])
        cut = dict(zip(offs[scu[r] : scu[r + 1]], slots[scu[r] : scu[r + 1]], strict=True))
        n = cu[r + 1] - cu[r]
        cut[n] = int(batch.write_slot[r])
        for i in range(n):
            t = cu[r] + i
            window.append(batch.xBC[t].float())
            acc = p.conv_bias.float().clone() if p.conv_bias is not None else 0.0
            for k in range(K):
                acc = acc + p.conv_weight[:, k].float() * window[-K + k]
            xbc = F.silu(acc).to(batch.xBC.dtype).float()
            for h in range(p.n_heads):
                g = h // (p.n_heads // p.n_groups)
                x = xbc[h * p.head_dim : (h + 1) * p.head_dim]
                b0 = p.d_inner + g * p.d_state
                c0 = p.d_inner + (p.n_groups + g) * p.d_state
                B, C = xbc[b0 : b0 + p.d_state], xbc[c0 : c0 + p.d_state]
                d = F.softplus(batch.dt[t, h].float() + p.dt_bias[h].float())
                d = d.clamp(p.dt_min, p.dt_max)
                for pi in range(p.head_dim):
                    S[h, pi] = torch.exp(d * A[h]) * S[h, pi] + d * x[pi] * B
                    y[t, h, pi] = (S[h, pi] * C).sum() + p.D[h].float() * x[pi]
            if i + 1 in cut and cut[i + 1] >= 0:
                conv = torch.stack(window[len(window) - (K - 1) :], dim=1)
                writes.append((cut[i + 1], conv, S.clone()))
    return y, writes


@pytest.mark.parametrize("dt_limit", [(0.0, float("inf")), (0.05, 0.6)])
def test_prefill_reference_is_the_recurrence(dt_limit):
    p = random_params(**SHAPES, dt_limit=dt_limit)
    conv, ssm = random_pools(p, 12, torch.float32, torch.float32)
    batch = random_batch(
        p, [1, 6, 9], reads=[3, -1, 5], writes=[3, 7, 8],
        bounds=[[], [(2, 9), (4, 10)], [(4, 11)]],
    )  # fmt: skip
    y_plain, writes = plain_recurrence(p, batch, conv, ssm)
    conv_ref, ssm_ref = conv.clone(), ssm.clone()
    y = mamba_prefill_reference(
        batch.xBC, batch.dt, batch.cu_seqlens, p, conv_ref, ssm_ref, batch.read_slot,
        batch.write_slot, batch.state_cu, batch.state_offsets, batch.state_slots, chunk_size=4,
    )  # fmt: skip
    torch.testing.assert_close(y, y_plain, atol=1e-5, rtol=1e-5)
    assert len(writes) == 6
    written = {slot for slot, _, _ in writes}
    for slot, c, s in writes:
        torch.testing.assert_close(conv_ref[slot], c, atol=0, rtol=0)
        torch.testing.assert_close(ssm_ref[slot], s, atol=1e-5, rtol=1e-5)
    for slot in set(range(12)) - written:
        assert torch.equal(conv_ref[slot], conv[slot]) and torch.equal(ssm_ref[slot], ssm[slot])


def test_prefill_reference_matches_transformers():
    p = random_params(**SHAPES, dt_limit=(0.01, 0.8))
    conv, ssm = random_pools(p, 4, torch.float32, torch.float32)
    batch = random_batch(p, [5, 11], reads=[1, -1], writes=[2, 3])
    y = mamba_prefill_reference(
        batch.xBC, batch.dt, batch.cu_seqlens, p, conv.clone(), ssm_out := ssm.clone(),
        batch.read_slot, batch.write_slot, chunk_size=4,
    )  # fmt: skip
    A = -torch.exp(p.A_log.float())
    for r, (s, e) in enumerate([(0, 5), (5, 16)]):
        read = int(batch.read_slot[r])
        init_conv = conv[read] if read >= 0 else torch.zeros(p.conv_dim, p.d_conv - 1)
        init_ssm = ssm[read] if read >= 0 else torch.zeros(ssm.shape[1:])
        full = torch.cat([init_conv, batch.xBC[s:e].t()], dim=1)[None]
        xbc = mb.causal_conv1d_fn(full, p.conv_weight, p.conv_bias, activation="silu")
        xbc = xbc[0, :, p.d_conv - 1 :].t()
        x, B, C = xbc.split([p.d_inner, p.n_groups * p.d_state, p.n_groups * p.d_state], -1)
        L = e - s
        y_hf, state_hf = mb.mamba2_chunk_scan(
            x.reshape(1, L, p.n_heads, p.head_dim), batch.dt[s:e][None], A,
            B.reshape(1, L, p.n_groups, p.d_state), C.reshape(1, L, p.n_groups, p.d_state),
            chunk_size=8, D=p.D, dt_bias=p.dt_bias, initial_states=init_ssm[None],
            dt_softplus=True, dt_limit=(p.dt_min, p.dt_max), return_final_states=True,
        )  # fmt: skip
        torch.testing.assert_close(y[s:e], y_hf[0], atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(ssm_out[int(batch.write_slot[r])], state_hf[0], atol=2e-5,
                                   rtol=2e-5)  # fmt: skip


def test_decode_reference_matches_transformers():
    p = random_params(**SHAPES)
    conv, ssm = random_pools(p, 5, torch.float32, torch.float32)
    batch = random_batch(p, [1, 1, 1], reads=[0, 2, 4], writes=[0, 1, 3])
    conv_ref, ssm_ref = conv.clone(), ssm.clone()
    y = mamba_decode_step_reference(
        batch.xBC, batch.dt, p, conv_ref, ssm_ref, batch.read_slot, batch.write_slot
    )
    reads = batch.read_slot.long()
    conv_hf, ssm_hf = conv[reads].clone(), ssm[reads].clone()
    xbc = mb.causal_conv1d_update(batch.xBC[:, :, None], conv_hf, p.conv_weight, p.conv_bias,
                                  activation="silu")[:, :, 0]  # fmt: skip
    x, B, C = xbc.split([p.d_inner, p.n_groups * p.d_state, p.n_groups * p.d_state], -1)
    H, P, N = p.n_heads, p.head_dim, p.d_state
    y_hf = mb.mamba2_selective_state_update(
        ssm_hf, x.reshape(3, H, P), batch.dt[:, :, None].expand(3, H, P),
        (-torch.exp(p.A_log.float()))[:, None, None].expand(H, P, N),
        B.reshape(3, p.n_groups, N), C.reshape(3, p.n_groups, N),
        p.D[:, None].expand(H, P), dt_bias=p.dt_bias[:, None].expand(H, P), dt_softplus=True,
    )  # fmt: skip
    torch.testing.assert_close(y, y_hf, atol=1e-5, rtol=1e-5)
    writes = batch.write_slot.long()
    torch.testing.assert_close(conv_ref[writes], conv_hf, atol=0, rtol=0)
    torch.testing.assert_close(ssm_ref[writes], ssm_hf, atol=1e-5, rtol=1e-5)
