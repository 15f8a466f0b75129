"""The standard RoPE cos/sin table (base 10000) in the layout kv_insert reads."""

from __future__ import annotations

import torch


def cos_sin_cache(max_position: int, rotary_dim: int, device: torch.device) -> torch.Tensor:
    """[max_position, rotary_dim]: cos of each frequency, then sin."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    freqs = torch.outer(torch.arange(max_position).float(), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(device)
