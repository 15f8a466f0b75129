"""Attention kernels: paged prefill/decode, KV insert, cache layout, backends, CPU decode."""
