"""Mamba2 (SSD) state kernels for hybrid attention + Mamba2 models (Bamba, GraniteMoeHybrid).

- `params`: the per-layer weights bundle (`MambaParams`) and the entry checks shared by the
  launchers (state pools, slots);
- `reference`: pure-PyTorch references of the decode step and the varlen prefill (chunked SSD);
- `decode_step`: one token per request: conv-state shift + conv + SiLU, then the single-step
  SSM update (`mamba_decode_step`), CUDA-graph capturable;
- `prefill`: packed varlen prefill (`mamba_prefill`): causal conv continuing from each request's
  conv state, the scan, final and block-boundary states written to their slots;
- `conv_kernel`: the causal depthwise conv + SiLU and the conv states (decode and prefill);
- `chunk_scan_kernel`: the chunked SSD scan (prefill's default);
- `scan_kernel`: the sequential recurrence (the decode step; prefill with chunk_size=None);
- `ssm_math`: softplus with the dt clamp, SiLU, a scalar-mask helper;
- `cases`: random weights / pools / batches for the tests and the benchmark;
- `bench`: a small timing function with the bytes each kernel must move.

State pools (fixed by the serving system), indexed by block id:
  conv state `[num_blocks, conv_dim, d_conv - 1]`: the last d_conv - 1 conv inputs, oldest first;
  SSM state  `[num_blocks, n_heads, head_dim, d_state]`: fp32 or the model dtype.
A slot of -1 reads a zero state / writes nothing.
"""
