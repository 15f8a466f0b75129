"""Layer kernels: RMSNorm with the residual add, SiLU-and-multiply, fused MoE."""
