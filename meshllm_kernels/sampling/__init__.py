"""Sampling maths: the Murmur3 counter RNG, Gumbel-max (PyTorch reference) and its kernel."""
