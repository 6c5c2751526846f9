"""Lloyd-Max (MSE-optimal scalar) codebooks for a standard normal source."""

from __future__ import annotations

import functools
import math

import numpy as np


@functools.cache
def gaussian_codebook(bits: int, iters: int = 300) -> np.ndarray:
    """Lloyd-Max centroids for N(0, 1) with ``2**bits`` levels (float64, ascending).

    Computed by Lloyd's iteration with exact Gaussian cell means (pdf/cdf in closed form).
    """
    n = 1 << bits
    c = np.linspace(-2.5, 2.5, n)
    erf = np.vectorize(math.erf)
    for _ in range(iters):
        edges = np.concatenate(([-np.inf], (c[1:] + c[:-1]) / 2, [np.inf]))
        pdf = np.exp(-(edges**2) / 2) / math.sqrt(2 * math.pi)
        cdf = 0.5 * (1 + erf(edges / math.sqrt(2)))
        mass = np.diff(cdf)
        c = (pdf[:-1] - pdf[1:]) / mass
    return c
