"""Random layers, state pools and batches for the Mamba2 kernel tests and benchmark."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from meshllm_kernels.mamba.params import MambaParams


def random_params(
    n_heads: int,
    head_dim: int,
    n_groups: int,
    d_state: int,
    d_conv: int = 4,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    seed: int = 0,
    conv_bias: bool = True,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
) -> MambaParams:
    """Weights in the ranges of trained Mamba2 layers: A = -(1..16), dt around softplus(-2..1)."""
    g = torch.Generator().manual_seed(seed)
    conv_dim = n_heads * head_dim + 2 * n_groups * d_state

    def rnd(*shape: int, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale + shift).to(dtype).to(device)

    return MambaParams(
        conv_weight=rnd(conv_dim, d_conv, scale=0.5),
        conv_bias=rnd(conv_dim, scale=0.2) if conv_bias else None,
        dt_bias=rnd(n_heads, scale=0.5, shift=-1.0),
        A_log=torch.log(torch.rand(n_heads, generator=g) * 15 + 1).to(dtype).to(device),
        D=rnd(n_heads, scale=0.5, shift=1.0),
        n_groups=n_groups,
        head_dim=head_dim,
        d_state=d_state,
        dt_min=dt_limit[0],
        dt_max=dt_limit[1],
    )


def random_pools(
    p: MambaParams,
    num_blocks: int,
    conv_dtype: torch.dtype,
    ssm_dtype: torch.dtype,
    seed: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Conv and SSM pools filled with random values (so a wrong read or write shows)."""
    g = torch.Generator().manual_seed(seed)
    device = p.A_log.device
    conv = torch.randn(num_blocks, p.conv_dim, p.d_conv - 1, generator=g).to(conv_dtype)
    ssm = torch.randn(num_blocks, p.n_heads, p.head_dim, p.d_state, generator=g).to(ssm_dtype)
    return conv.to(device), ssm.to(device)


@dataclass
class Batch:
    """Packed tokens of several requests and their slots (kernel argument names)."""

    xBC: torch.Tensor  # [T, conv_dim]
    dt: torch.Tensor  # [T, n_heads]
    cu_seqlens: torch.Tensor  # [R + 1] int32
    read_slot: torch.Tensor  # [R]
    write_slot: torch.Tensor  # [R]
    state_cu: torch.Tensor  # [R + 1] int32
    state_offsets: torch.Tensor  # [K] int32, token counts from the span's start
    state_slots: torch.Tensor  # [K]


def random_batch(
    p: MambaParams,
    seqlens: list[int],
    reads: list[int],
    writes: list[int],
    bounds: list[list[tuple[int, int]]] | None = None,
    dtype: torch.dtype = torch.float32,
    seed: int = 2,
) -> Batch:
    """A packed batch: seqlens per request, read / write slots, per request (offset, slot)
    boundary states."""
    g = torch.Generator().manual_seed(seed)
    device = p.A_log.device
    T = sum(seqlens)
    bounds = bounds or [[] for _ in seqlens]
    cu = [0]
    for n in seqlens:
        cu.append(cu[-1] + n)
    scu = [0]
    for b in bounds:
        scu.append(scu[-1] + len(b))
    flat = [pair for b in bounds for pair in b]

    def ints(v: list[int]) -> torch.Tensor:
        return torch.tensor(v, dtype=torch.int32, device=device)

    return Batch(
        xBC=torch.randn(T, p.conv_dim, generator=g).to(dtype).to(device),
        dt=(torch.randn(T, p.n_heads, generator=g) * 0.7).to(dtype).to(device),
        cu_seqlens=ints(cu),
        read_slot=ints(reads),
        write_slot=ints(writes),
        state_cu=ints(scu),
        state_offsets=ints([o for o, _ in flat]),
        state_slots=ints([s for _, s in flat]),
    )
