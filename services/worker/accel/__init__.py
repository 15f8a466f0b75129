"""Faster paths where the device has them: Triton layers, the decode chain, graphs, inductor."""
