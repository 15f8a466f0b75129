"""meshllm's kernels: each module holds a Triton (or C++) kernel, its launcher with input
checks, and the PyTorch reference it is tested against.

- `attention/`: paged prefill and decode attention, the KV insert with fused RoPE, the cache
  layout they share, the backends' declared capabilities, the CPU C++ decode kernel;
- `decode_chain/`: the fused batch-1..16 decode forward on CUDA (GEMVs, the decode attention
  read straight from the qkv partials, the embedding + first norm, the token feed);
- `layers/`: RMSNorm(+residual), SiLU-and-multiply, fused MoE;
- `sampling/`: the Murmur3 counter RNG and Gumbel-max maths (reference) and its fused kernel;
- `runtime/`: what the launchers share (entry checks, PDL hand-off, completion counters,
  pinned host->device copies).

Kernel modules bind `@triton.jit` at import (compiler or interpreter), so the package
`__init__` files import nothing: a CPU worker never needs Triton.
"""
