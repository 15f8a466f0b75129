"""Goodness-of-fit helpers for sampler tests (no scipy): chi-square p-values and z-scores."""

from __future__ import annotations

import math

import torch


def chi_square_pvalue(observed: torch.Tensor, expected: torch.Tensor) -> float:
    """Upper-tail p-value of Pearson's chi-square, df = cells - 1.

    Uses the Wilson-Hilferty cube-root normal approximation, accurate to a few percent of
    the p-value for df >= 2 and expected counts >= 5 (the tests keep to that).
    """
    observed = observed.double()
    expected = expected.double()
    if bool((expected < 5).any()):
        raise ValueError("every cell needs an expected count >= 5")
    stat = float(((observed - expected) ** 2 / expected).sum())
    df = observed.numel() - 1
    z = ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


def binomial_z(count: int, trials: int, p: float) -> float:
    return (count - trials * p) / math.sqrt(trials * p * (1 - p))
