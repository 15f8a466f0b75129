"""The Mamba2 mixer's math as plain PyTorch ops (any device): the causal depthwise conv with a
carried state, the SSD scan over a span (chunked, transformers' `mamba2_chunk_scan`), the
one-token recurrent update (transformers' `mamba2_selective_state_update`), and the gated
grouped RMSNorm. fp32 inputs reproduce transformers' `torch_forward` numerics (same op order).

Shapes use one request's span of T tokens (scan, conv) or R requests of one token each (step):
H heads of P channels, G groups of N state channels, C = conv channels, K = conv width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv(
    x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(silu(conv(x)) [T, C], the padded input [C, K - 1 + T]) for one span.

    `conv_state` [C, K - 1] holds the K - 1 inputs before the span (zeros at a request's
    start); the conv state after the span's first j tokens is `padded[:, j : j + K - 1]`."""
    width = weight.shape[-1]
    padded = torch.cat([conv_state.to(x.dtype), x.t()], dim=-1)
    out = F.conv1d(padded[None], weight[:, None, :], bias, groups=weight.shape[0])[0]
    assert out.shape[-1] == x.shape[0], (out.shape, x.shape, width)
    return F.silu(out).t(), padded


def causal_conv_step(
    x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(silu(conv) [R, C], new conv states [R, C, K - 1]) for one token of each of R requests
    (x [R, C], conv_state [R, C, K - 1])."""
    window = torch.cat([conv_state.to(x.dtype), x[:, :, None]], dim=-1)  # [R, C, K]
    out = (window * weight[None]).sum(-1)
    if bias is not None:
        out = out + bias
    return F.silu(out), window[:, :, 1:]


def _segment_sum(x: torch.Tensor) -> torch.Tensor:
    """transformers' stable segment sum: [..., L] -> [..., L, L], -inf above the diagonal."""
    length = x.size(-1)
    x = x[..., None].expand(*x.size(), length)
    strict = torch.tril(torch.ones(length, length, device=x.device, dtype=torch.bool), -1)
    x = x.masked_fill(~strict, 0)
    out = torch.cumsum(x, dim=-2)
    lower = torch.tril(torch.ones(length, length, device=x.device, dtype=torch.bool), 0)
    return out.masked_fill(~lower, -torch.inf)


def ssd_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
    chunk_size: int,
    initial_state: torch.Tensor,
    lead: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y [T, H, P] fp32, the state after each chunk [c, H, P, N] fp32) of the SSD recurrence
    over one span; the last is the final state.

    x [T, H, P]; dt [T, H] (before bias and softplus); A [H] (negative); B, C [T, G, N];
    initial_state [H, P, N]. transformers' chunked algorithm for a batch of one, with `lead`
    neutral positions first (no input, no decay: dt = 0), so that chunk k ends after
    (k + 1) * chunk_size - lead real tokens: block boundaries, when a span starts `lead`
    tokens into a block and chunk_size is the block size. The padding at the end is neutral
    too, so the last chunk's state is the state after the whole span."""
    seq_len, num_heads, head_dim = x.shape
    groups = B.shape[1]
    dt = F.softplus(dt + dt_bias.to(dt.dtype))
    x = x.float()[None]
    B = B.float().repeat_interleave(num_heads // groups, dim=1)[None]
    C = C.float().repeat_interleave(num_heads // groups, dim=1)[None]
    dt = dt.float()[None]
    pad = (chunk_size - (lead + seq_len) % chunk_size) % chunk_size
    d_residual = D[:, None].float() * x
    x = x * dt[..., None]
    A = A.float() * dt  # [1, T, H]

    def chunks(t: torch.Tensor) -> torch.Tensor:
        t = F.pad(t, (0, 0, 0, 0, lead, pad) if t.dim() == 4 else (0, 0, lead, pad))
        return t.reshape(1, -1, chunk_size, *t.shape[2:])

    x, A, B, C = chunks(x), chunks(A), chunks(B), chunks(C)
    A = A.permute(0, 3, 1, 2)  # [1, H, c, l]
    A_cumsum = torch.cumsum(A, dim=-1)
    L = torch.exp(_segment_sum(A))
    G = torch.einsum("bclhn,bcshn->bclsh", C, B)
    M = G * L.permute(0, 2, 3, 4, 1)
    y_diag = torch.einsum("bclsh,bcshp->bclhp", M, x)
    decay_states = torch.exp(A_cumsum[:, :, :, -1:] - A_cumsum)
    B_decay = B * decay_states.permute(0, -2, -1, 1)[..., None]
    states = torch.einsum("bclhn,bclhp->bchpn", B_decay, x)
    previous = initial_state[None, None].float()
    states = torch.cat([previous, states], dim=1)
    decay_chunk = torch.exp(_segment_sum(F.pad(A_cumsum[:, :, :, -1], (1, 0)))).transpose(1, 3)
    new_states = torch.einsum("bzch,bzhpn->bchpn", decay_chunk, states)
    states = new_states[:, :-1]
    state_decay_out = torch.exp(A_cumsum)
    c_states = torch.einsum("bclhn,bchpn->bclhp", C, states)
    y_off = c_states * state_decay_out.permute(0, 2, 3, 1)[..., None]
    y = (y_diag + y_off).reshape(1, -1, num_heads, head_dim)[:, lead : lead + seq_len]
    return (y + d_residual)[0], new_states[0, 1:]


def ssd_step(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y [R, H, P], new state [R, H, P, N]) of one token of each of R requests.

    state [R, H, P, N]; x [R, H, P]; dt [R, H] (before bias and softplus); B, C [R, G, N]."""
    rows, num_heads, head_dim = x.shape
    groups, d_state = B.shape[1], B.shape[2]
    dt = F.softplus(dt + dt_bias.to(dt.dtype))[..., None, None]  # [R, H, 1, 1]
    dA = torch.exp(dt.float() * A.float()[None, :, None, None])
    B = B[:, :, None, :].expand(rows, groups, num_heads // groups, d_state)
    B = B.reshape(rows, num_heads, 1, d_state)
    dBx = dt * B * x[..., None]
    new_state = state * dA + dBx
    C = C[:, :, None, :].expand(rows, groups, num_heads // groups, d_state)
    C = C.reshape(rows * num_heads, d_state, 1)
    y = torch.bmm(new_state.to(C.dtype).reshape(rows * num_heads, head_dim, d_state), C)
    y = y.view(rows, num_heads, head_dim) + x * D[:, None]
    return y.to(x.dtype), new_state.to(state.dtype)


def gated_rms_norm(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, group_size: int, eps: float
) -> torch.Tensor:
    """weight * rmsnorm_per_group(x * silu(gate)), in fp32 and cast back (transformers'
    MambaRMSNormGated with norm_before_gate=False)."""
    dtype = x.dtype
    h = x.float() * F.silu(gate.float())
    *prefix, last = h.shape
    grouped = h.view(*prefix, last // group_size, group_size)
    grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + eps)
    return weight * grouped.view(*prefix, last).to(dtype)
