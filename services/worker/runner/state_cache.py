"""Per-block recurrent states of a hybrid model's state (Mamba2) layers.

A state layer owns, per block id of the state pool (shared/kv/groups.py), a conv state
`[num_state_blocks, conv_dim, d_conv - 1]` (the last inputs of the causal conv) and an SSM
state `[num_state_blocks, n_heads, head_dim, d_state]`; attention layers keep their per-token
K/V tensors (kv_cache.py) in a pool of their own. Which block a step reads and writes follows
the entry rule (services/worker/attention/state_metadata.py), over the state group's block
table, whose ids index the state pool only (the scheduler hands them out of its state
BlockPool); state_pool.py sizes the pool.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.model.config import MambaConfig


@dataclass
class MambaState:
    """One state layer's per-block states."""

    conv: torch.Tensor  # [num_state_blocks, conv_dim, d_conv - 1]
    ssm: torch.Tensor  # [num_state_blocks, n_heads, head_dim, d_state]

    @classmethod
    def allocate(
        cls, mamba: MambaConfig, num_blocks: int, dtype: torch.dtype, device: torch.device | str
    ) -> MambaState:
        return cls(
            conv=torch.zeros(
                num_blocks, mamba.conv_dim, mamba.d_conv - 1, dtype=dtype, device=device
            ),
            ssm=torch.zeros(
                num_blocks, mamba.n_heads, mamba.head_dim, mamba.d_state, dtype=dtype, device=device
            ),
        )

    @property
    def dtype(self) -> torch.dtype:
        return self.conv.dtype

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.conv, self.ssm))


def state_bytes_per_block(mamba: MambaConfig, dtype: torch.dtype) -> int:
    """Conv and SSM state of one block id in one state layer."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    conv = mamba.conv_dim * (mamba.d_conv - 1)
    ssm = mamba.n_heads * mamba.head_dim * mamba.d_state
    return (conv + ssm) * itemsize
