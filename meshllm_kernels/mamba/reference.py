"""Pure-PyTorch references of the Mamba2 state kernels, argument for argument.

Math (transformers' Mamba2 / Bamba mixer), per request, heads h, groups g = h // (H / G):
  conv:  xBC'_t = dtype(SiLU(bias + sum_k w[:, k] * in_{t - d_conv + 1 + k}))  (depthwise,
         causal, continuing from the conv state's d_conv - 1 earlier inputs; fp32 sums, the
         result rounded to the activation dtype as transformers' causal_conv1d does)
  dt_t = clamp(softplus(dt_t + dt_bias), dt_min, dt_max), A = -exp(A_log)      (all fp32)
  S_t  = exp(dt_t * A) * S_{t-1} + dt_t * x_t (outer) B_t                     ([P, N] per head)
  y_t  = S_t . C_t + D * x_t
Everything after the conv is fp32 (states are read and updated in fp32 and rounded to the pool's
dtype only when stored); y is rounded to `out_dtype` (default: xBC's dtype). The prefill scan is
the chunked SSD form (intra-chunk quadratic form + inter-chunk state passing), cut additionally
at each requested boundary, so it shares no code with the kernels' sequential recurrence.

Against transformers (tests/kernels/test_mamba_reference.py): equal in fp32. In 16-bit models
transformers rounds more often (dt + dt_bias and softplus in the model dtype on both paths;
dt * B * x and C . S in the model dtype on the decode path), and its decode path ignores
time_step_limit (which defaults to (0, inf), a no-op); here both paths clamp.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from meshllm_kernels.mamba.params import MambaParams


def dt_softplus(dt: torch.Tensor, p: MambaParams) -> torch.Tensor:
    """clamp(softplus(dt + dt_bias)) in fp32 (softplus with torch's threshold 20)."""
    dt = F.softplus(dt.float() + p.dt_bias.float())
    return dt.clamp(min=p.dt_min, max=p.dt_max)


def A_of(p: MambaParams) -> torch.Tensor:
    return -torch.exp(p.A_log.float())


def _read(pool: torch.Tensor, slot: int, shape: tuple[int, ...]) -> torch.Tensor:
    if slot < 0:
        return torch.zeros(shape, dtype=torch.float32, device=pool.device)
    return pool[slot].float().clone()


def _conv(window: torch.Tensor, p: MambaParams, dtype: torch.dtype) -> torch.Tensor:
    """window [conv_dim, d_conv - 1 + L] (fp32) -> SiLU(conv) [L, conv_dim] in dtype."""
    out = F.conv1d(
        window[None],
        p.conv_weight.float()[:, None, :],
        None if p.conv_bias is None else p.conv_bias.float(),
        groups=p.conv_dim,
    )[0]
    return F.silu(out).to(dtype).t()


def _split(xbc: torch.Tensor, p: MambaParams) -> tuple[torch.Tensor, ...]:
    """xBC' [L, conv_dim] -> x [L, H, P], B [L, H, N], C [L, H, N] (fp32, B/C per head)."""
    L = xbc.shape[0]
    x, B, C = xbc.float().split([p.d_inner, p.n_groups * p.d_state, p.n_groups * p.d_state], -1)
    rep = p.n_heads // p.n_groups
    B = B.reshape(L, p.n_groups, p.d_state).repeat_interleave(rep, dim=1)
    C = C.reshape(L, p.n_groups, p.d_state).repeat_interleave(rep, dim=1)
    return x.reshape(L, p.n_heads, p.head_dim), B, C


def mamba_decode_step_reference(
    xBC: torch.Tensor,
    dt: torch.Tensor,
    p: MambaParams,
    conv_state: torch.Tensor,
    ssm_state: torch.Tensor,
    read_slot: torch.Tensor,
    write_slot: torch.Tensor,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Reference of `mamba_decode_step`: xBC [B, conv_dim], dt [B, n_heads] -> y [B, H, P]."""
    cu_seqlens = torch.arange(xBC.shape[0] + 1, dtype=torch.int32, device=xBC.device)
    return mamba_prefill_reference(
        xBC, dt, cu_seqlens, p, conv_state, ssm_state, read_slot, write_slot, out_dtype=out_dtype
    )


def ssd_chunked(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """SSD over one span, fp32: x [L, H, P], dt [L, H], A [H], B/C [L, H, N], state [H, P, N]
    -> (y without the D skip [L, H, P], final state [H, P, N]). Chunks of chunk_size tokens
    (the last may be shorter): within a chunk y = (C B^T * decay mask) (dt x) + decay * C S_0,
    and the chunk's end state is decay_total * S_0 + sum_s decay_to_end_s dt_s B_s x_s."""
    ys = []
    for c0 in range(0, x.shape[0], chunk_size):
        xc, dtc = x[c0 : c0 + chunk_size], dt[c0 : c0 + chunk_size]
        Bc, Cc = B[c0 : c0 + chunk_size], C[c0 : c0 + chunk_size]
        acum = torch.cumsum(dtc * A, dim=0)  # [l, H]
        n = xc.shape[0]
        causal = torch.ones(n, n, dtype=torch.bool, device=x.device).tril()
        seg = (acum[:, None, :] - acum[None, :, :]).masked_fill(~causal[:, :, None], -torch.inf)
        M = torch.einsum("thn,shn->tsh", Cc, Bc) * torch.exp(seg)
        y_diag = torch.einsum("tsh,sh,shp->thp", M, dtc, xc)
        y_off = torch.einsum("thn,hpn->thp", Cc, state) * torch.exp(acum)[:, :, None]
        ys.append(y_diag + y_off)
        to_end = torch.exp(acum[-1][None, :] - acum) * dtc  # [l, H]
        state = state * torch.exp(acum[-1])[:, None, None] + torch.einsum(
            "sh,shn,shp->hpn", to_end, Bc, xc
        )
    return torch.cat(ys, dim=0), state


def mamba_prefill_reference(
    xBC: torch.Tensor,
    dt: torch.Tensor,
    cu_seqlens: torch.Tensor,
    p: MambaParams,
    conv_state: torch.Tensor,
    ssm_state: torch.Tensor,
    read_slot: torch.Tensor,
    write_slot: torch.Tensor,
    state_cu: torch.Tensor | None = None,
    state_offsets: torch.Tensor | None = None,
    state_slots: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    chunk_size: int = 4,
) -> torch.Tensor:
    """Reference of `mamba_prefill` (same arguments; Python loops over requests). All initial
    states are read before any state is written, so a read slot equal to a write slot reads
    the old state."""
    K1 = p.d_conv - 1
    R = cu_seqlens.shape[0] - 1
    cu = cu_seqlens.tolist()
    reads, writes = read_slot.tolist(), write_slot.tolist()
    if state_cu is None:
        bounds: list[list[tuple[int, int]]] = [[] for _ in range(R)]
    else:
        scu, offs, slots = state_cu.tolist(), state_offsets.tolist(), state_slots.tolist()
        pairs = list(zip(offs, slots, strict=True))
        bounds = [pairs[scu[r] : scu[r + 1]] for r in range(R)]
    init_conv = [_read(conv_state, s, (p.conv_dim, K1)) for s in reads]
    init_ssm = [_read(ssm_state, s, (p.n_heads, p.head_dim, p.d_state)) for s in reads]
    A = A_of(p)
    y = torch.empty(xBC.shape[0], p.n_heads, p.head_dim, dtype=out_dtype or xBC.dtype,
                    device=xBC.device)  # fmt: skip
    for r in range(R):
        s, e = cu[r], cu[r + 1]
        if e == s:  # an empty span passes its initial states on
            if writes[r] >= 0:
                conv_state[writes[r]] = init_conv[r].to(conv_state.dtype)
                ssm_state[writes[r]] = init_ssm[r].to(ssm_state.dtype)
            continue
        window = torch.cat([init_conv[r], xBC[s:e].float().t()], dim=1)
        x, B, C = _split(_conv(window, p, xBC.dtype), p)
        dtr = dt_softplus(dt[s:e], p)
        state, t0, ys = init_ssm[r], 0, []
        for t1, slot in [*bounds[r], (e - s, writes[r])]:
            if t1 > t0:
                yseg, state = ssd_chunked(x[t0:t1], dtr[t0:t1], A, B[t0:t1], C[t0:t1], state,
                                          chunk_size)  # fmt: skip
                ys.append(yseg)
                t0 = t1
            if slot >= 0:
                conv_state[slot] = window[:, t1 : t1 + K1].to(conv_state.dtype)
                ssm_state[slot] = state.to(ssm_state.dtype)
        y[s:e] = (torch.cat(ys) + p.D.float()[:, None] * x).to(y.dtype)
    return y
