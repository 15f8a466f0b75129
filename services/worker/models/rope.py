"""Rotary position embeddings (neox / rotate-half style, as Llama uses) with scaling variants.

The inverse frequencies follow transformers' `ROPE_INIT_FUNCTIONS` exactly (tests compare them),
so a checkpoint behaves as its authors trained it. cos/sin are precomputed once for every
position up to `max_position` and looked up by position per step (one gather shared by all
layers), because positions in a flat batch are arbitrary per token.

Dynamic NTK is applied statically at the cache length (`max_position`), as vLLM does: the
frequencies of a token may not depend on what else is in the batch, and cached keys must keep
the rotation they were written with. For `max_position <= max_position_embeddings` it is the
plain RoPE, which is also what transformers computes for such sequences.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from shared.model.config import RopeScaling


def rotary_dim(head_dim: int, rope: RopeScaling) -> int:
    return int(head_dim * rope.partial_rotary_factor)


def _base_inv_freq(base: float, dim: int) -> torch.Tensor:
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim
    return 1.0 / (base**exponents)


def compute_inv_freq(
    rope: RopeScaling, head_dim: int, max_position_embeddings: int, seq_len: int | None = None
) -> tuple[torch.Tensor, float]:
    """(inv_freq [rotary_dim/2] fp32, attention_factor applied to cos/sin)."""
    dim = rotary_dim(head_dim, rope)
    base = rope.theta
    original = rope.original_max_position_embeddings or max_position_embeddings
    if rope.rope_type == "default":
        return _base_inv_freq(base, dim), 1.0
    if rope.rope_type == "linear":
        return _base_inv_freq(base, dim) / rope.factor, 1.0
    if rope.rope_type == "dynamic":
        length = max(seq_len or max_position_embeddings, max_position_embeddings)
        scaled = rope.factor * length / max_position_embeddings - (rope.factor - 1)
        return _base_inv_freq(base * scaled ** (dim / (dim - 2)), dim), 1.0
    if rope.rope_type == "llama3":
        return _llama3_inv_freq(rope, base, dim, original), 1.0
    if rope.rope_type == "yarn":
        return _yarn_inv_freq(rope, base, dim, original, max_position_embeddings)
    raise ValueError(f"unknown rope type {rope.rope_type!r}")


def _llama3_inv_freq(rope: RopeScaling, base: float, dim: int, old_context: int) -> torch.Tensor:
    inv_freq = _base_inv_freq(base, dim)
    low_wavelen = old_context / rope.low_freq_factor
    high_wavelen = old_context / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_context / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(
    rope: RopeScaling, base: float, dim: int, original: int, max_position_embeddings: int
) -> tuple[torch.Tensor, float]:
    factor = rope.factor or max_position_embeddings / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = rope.attention_factor
    if attention_factor is None:
        if rope.mscale and rope.mscale_all_dim:
            attention_factor = mscale(factor, rope.mscale) / mscale(factor, rope.mscale_all_dim)
        else:
            attention_factor = mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast or 32), correction_dim(rope.beta_slow or 1)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep, float(attention_factor)


class RotaryEmbedding(nn.Module):
    """cos/sin tables [max_position, rotary_dim] in the model dtype (as transformers casts them).

    Buffers are non-persistent: they are derived from the config, never loaded from a checkpoint.
    """

    def __init__(
        self,
        head_dim: int,
        rope: RopeScaling,
        max_position: int,
        max_position_embeddings: int,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim(head_dim, rope)
        self.rope = rope
        self.max_position = max_position
        self.max_position_embeddings = max_position_embeddings
        self.register_buffer("cos", torch.empty(max_position, self.rotary_dim, dtype=dtype), False)
        self.register_buffer("sin", torch.empty(max_position, self.rotary_dim, dtype=dtype), False)
        half = self.rotary_dim // 2
        # cos | sin of the unique frequencies per position: the row a fused RoPE kernel reads
        # (meshllm_kernels/decode_chain/decode_from_qkv.py) by position, without a per-step lookup.
        self.register_buffer("cos_sin", torch.empty(max_position, 2 * half, dtype=dtype), False)
        if self.cos.device.type != "meta":
            self.materialize(self.cos.device, dtype)

    def materialize(self, device: torch.device | str, dtype: torch.dtype) -> None:
        """(Re)compute the tables on `device`; the loader calls it after a meta-device build."""
        inv_freq, attention_factor = compute_inv_freq(
            self.rope, self.head_dim, self.max_position_embeddings, seq_len=self.max_position
        )
        positions = torch.arange(self.max_position, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = (emb.cos() * attention_factor).to(device=device, dtype=dtype)
        self.sin = (emb.sin() * attention_factor).to(device=device, dtype=dtype)
        half = self.rotary_dim // 2
        self.cos_sin = torch.cat((self.cos[:, :half], self.sin[:, :half]), dim=-1).contiguous()

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, rotary_dim] for broadcasting over heads; computed once per step.

        Positions are not range-checked here (that would sync a GPU every step): the runner
        checks them against `max_position` on the host before building the batch.
        """
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim] rotated in neox style; only the first rotary_dim dims rotate."""
    rot = cos.shape[-1]
    if rot == x.shape[-1]:
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    x1, x2 = x_rot.chunk(2, dim=-1)
    rotated = x_rot * cos + torch.cat((-x2, x1), dim=-1) * sin
    return torch.cat((rotated, x_pass), dim=-1)
