"""The Mamba2 mixer of hybrid models (Bamba, GraniteMoeHybrid) over the flat token batch.

Parameters and their names are transformers' (`in_proj`, `conv1d`, `dt_bias`, `A_log`, `D`,
`norm`, `out_proj`), so checkpoints load unchanged. Per step the mixer reads each request's
state from the per-block state cache and writes the boundary and final states back, as the
step's `StateMetadata` says (services/worker/attention/state_metadata.py: the entry rule):

- one-token requests (the leading rows) run together: gather their states, one recurrent
  update, scatter the new states;
- each longer span runs one chunked SSD scan whose chunks are the span's pieces between block
  boundaries (the first chunk padded at the front with neutral positions), so the state after
  every chunk is the state at a boundary, stored in that boundary's block. (So the scan's
  chunk size is the KV block size, not the checkpoint's `mamba_chunk_size`: the chunked
  algorithm is exact for any chunk size, only the rounding differs.)

The math is mamba_ops.py (PyTorch, any device) on the reference path. Where the worker runs
Triton (CUDA; a StateMetadata built with `triton=True`), the conv + SSM run on the Triton
kernels (meshllm_kernels/mamba): the decode rows in one `mamba_decode_step` (slot tensors built on
the host, no host sync: CUDA-graph capturable), the prefill spans in one or two `mamba_prefill`
launches (StateMetadata's `launches`: boundary states included). Projections, the z gate and
the gated RMSNorm are the same modules on both paths.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from services.worker.attention.state_metadata import PrefillSpan, StateMetadata
from services.worker.models.layer_impls import REFERENCE, LayerImpls
from services.worker.models.mamba_ops import (
    causal_conv,
    causal_conv_step,
    gated_rms_norm,
    ssd_scan,
    ssd_step,
)
from services.worker.runner.state_cache import MambaState
from shared.model.config import ModelConfig

if TYPE_CHECKING:
    from meshllm_kernels.mamba.params import MambaParams


class GatedRMSNorm(nn.Module):
    """transformers' MambaRMSNormGated: RMSNorm per group of x * silu(gate)."""

    def __init__(self, hidden_size: int, group_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.group_size = group_size
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return gated_rms_norm(x, gate, self.weight, self.group_size, self.eps)


class Mamba2Mixer(nn.Module):
    def __init__(self, config: ModelConfig, impls: LayerImpls = REFERENCE) -> None:
        super().__init__()
        mamba = config.mamba
        if mamba is None:
            raise ValueError("a Mamba2 mixer needs ModelConfig.mamba")
        self.num_heads = mamba.n_heads
        self.head_dim = mamba.head_dim
        self.d_state = mamba.d_state
        self.n_groups = mamba.n_groups
        self.d_conv = mamba.d_conv
        self.intermediate_size = mamba.intermediate_size
        self.conv_dim = mamba.conv_dim
        self.in_proj = impls.linear(
            config.hidden_size,
            self.intermediate_size + self.conv_dim + self.num_heads,
            bias=mamba.proj_bias,
        )
        self.conv1d = nn.Conv1d(
            self.conv_dim,
            self.conv_dim,
            kernel_size=self.d_conv,
            groups=self.conv_dim,
            bias=mamba.conv_bias,
            padding=self.d_conv - 1,
        )
        self.dt_bias = nn.Parameter(torch.ones(self.num_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_heads))
        self.D = nn.Parameter(torch.ones(self.num_heads))
        self.norm = GatedRMSNorm(
            self.intermediate_size, self.intermediate_size // self.n_groups, config.rms_norm_eps
        )
        self.out_proj = impls.linear(self.intermediate_size, config.hidden_size, mamba.proj_bias)

    def forward(self, hidden: torch.Tensor, meta: StateMetadata, cache: MambaState) -> torch.Tensor:
        """hidden [T, hidden] of the flat batch -> [T, hidden]; states read and written in
        `cache` per `meta`."""
        projected = self.in_proj(hidden)
        gate, xbc, dt = projected.split(
            [self.intermediate_size, self.conv_dim, self.num_heads], dim=-1
        )
        if meta.triton:
            y = self._triton(xbc, dt, meta, cache)
            return self.out_proj(self.norm(y.to(hidden.dtype), gate))  # type: ignore[no-any-return]
        A = -torch.exp(self.A_log.float())
        outputs = []
        if meta.num_decodes:
            outputs.append(self._decodes(xbc, dt, A, meta, cache))
        for span in meta.prefills:
            rows = slice(span.start, span.end)
            outputs.append(self._span(xbc[rows], dt[rows], A, span, meta.block_size, cache))
        y = torch.cat(outputs) if len(outputs) > 1 else outputs[0]
        return self.out_proj(self.norm(y.to(hidden.dtype), gate))  # type: ignore[no-any-return]

    def kernel_params(self) -> MambaParams:
        from meshllm_kernels.mamba.params import MambaParams

        return MambaParams(
            conv_weight=self.conv1d.weight[:, 0],
            conv_bias=self.conv1d.bias,
            dt_bias=self.dt_bias,
            A_log=self.A_log,
            D=self.D,
            n_groups=self.n_groups,
            head_dim=self.head_dim,
            d_state=self.d_state,
        )

    def _triton(
        self, xbc: torch.Tensor, dt: torch.Tensor, meta: StateMetadata, cache: MambaState
    ) -> torch.Tensor:
        """y [T, intermediate] (before the gate) of every row through the Triton kernels."""
        from meshllm_kernels.mamba.decode_step import mamba_decode_step
        from meshllm_kernels.mamba.prefill import mamba_prefill

        params = self.kernel_params()
        d = meta.num_decodes
        y = xbc.new_empty(xbc.shape[0], self.num_heads, self.head_dim)
        if d:
            assert meta.decode_read_slot is not None and meta.decode_write_slot is not None
            y[:d] = mamba_decode_step(
                xbc[:d], dt[:d], params, cache.conv, cache.ssm,
                meta.decode_read_slot, meta.decode_write_slot,
            )  # fmt: skip
        for launch in meta.launches or ():
            lo, hi = launch.lo, launch.hi  # flat rows (the spans' rows follow the decodes)
            out = mamba_prefill(
                xbc[lo:hi], dt[lo:hi], launch.cu_seqlens, params, cache.conv, cache.ssm,
                launch.read_slot, launch.write_slot, launch.state_cu, launch.state_offsets,
                launch.state_slots,
            )  # fmt: skip
            if launch.take is None:
                y[lo:hi] = out
            else:
                y[lo:hi].index_copy_(0, launch.take, out.index_select(0, launch.take))
        return y.reshape(-1, self.intermediate_size)

    def _split(self, xbc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        groups = self.n_groups * self.d_state
        x, B, C = xbc.split([self.intermediate_size, groups, groups], dim=-1)
        rows = xbc.shape[0]
        return (
            x.reshape(rows, self.num_heads, self.head_dim),
            B.reshape(rows, self.n_groups, self.d_state),
            C.reshape(rows, self.n_groups, self.d_state),
        )

    def _decodes(
        self,
        xbc: torch.Tensor,
        dt: torch.Tensor,
        A: torch.Tensor,
        meta: StateMetadata,
        cache: MambaState,
    ) -> torch.Tensor:
        """The one-token rows [0, D): gather -> update -> scatter, vectorised over requests."""
        d = meta.num_decodes
        has = meta.decode_has_state.to(cache.dtype)
        conv = cache.conv.index_select(0, meta.decode_read) * has[:, None, None]
        ssm = cache.ssm.index_select(0, meta.decode_read) * has[:, None, None, None]
        weight = self.conv1d.weight[:, 0]
        xbc_d, conv = causal_conv_step(xbc[:d], conv, weight, self.conv1d.bias)
        x, B, C = self._split(xbc_d)
        y, ssm = ssd_step(ssm, x, dt[:d], A, B, C, self.D, self.dt_bias)
        cache.conv.index_copy_(0, meta.decode_write, conv.to(cache.dtype))
        cache.ssm.index_copy_(0, meta.decode_write, ssm.to(cache.dtype))
        return y.reshape(d, self.intermediate_size)

    def _span(
        self,
        xbc: torch.Tensor,
        dt: torch.Tensor,
        A: torch.Tensor,
        span: PrefillSpan,
        block_size: int,
        cache: MambaState,
    ) -> torch.Tensor:
        """One request's span of several tokens; the states at its block boundaries and its
        end go to their blocks."""
        if span.read_block >= 0:
            conv_state = cache.conv[span.read_block].clone()
            ssm_state = cache.ssm[span.read_block].clone()
        else:
            conv_state = cache.conv.new_zeros(cache.conv.shape[1:])
            ssm_state = cache.ssm.new_zeros(cache.ssm.shape[1:])
        xbc, padded = causal_conv(xbc, conv_state, self.conv1d.weight[:, 0], self.conv1d.bias)
        x, B, C = self._split(xbc)
        # One scan, its chunks cut at the block boundaries: the state after chunk j is the
        # state at segment j's end (a boundary, or the span's end for the last one).
        y, states = ssd_scan(
            x, dt, A, B, C, self.D, self.dt_bias, block_size, ssm_state.float(), span.lead
        )
        assert states.shape[0] == len(span.segments), (states.shape, span)
        ends = [end for end, _ in span.segments]
        blocks = torch.tensor([block for _, block in span.segments], device=cache.ssm.device)
        cache.ssm.index_copy_(0, blocks, states.to(cache.dtype))
        conv = torch.stack([padded[:, end : end + self.d_conv - 1] for end in ends])
        cache.conv.index_copy_(0, blocks, conv.to(cache.dtype))
        return y.reshape(-1, self.intermediate_size)
