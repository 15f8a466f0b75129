"""The fused decode chain on CUDA (batch 1..16): GEMVs, attention from qkv, feed, norms."""
