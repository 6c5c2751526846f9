"""95% intervals for the quality measures.

- ``wilson(k, n)``: Wilson score interval of a proportion (retrieval accuracy, share of
  identical outputs), the closed form of Wilson (1927); it stays inside [0, 1] and is not
  degenerate at 0 or n successes, unlike the normal approximation.
- ``mean_ci95(values)``: percentile bootstrap of a mean over prompts (first departure, words
  changed), seeded so a result file is reproducible.
- ``mcnemar_p(a, b)``: exact two-sided McNemar test of two paired pass/fail lists (a format
  and bf16 on the same samples): the binomial test on the discordant pairs.

(scipy.stats has all three, but scipy is neither in the workspace lock nor on the GPU
machines the protocol runs on; the formulas are short and tested against known values.)
"""

from __future__ import annotations

import math

import numpy as np

#: z of a two-sided 95% interval.
Z95 = 1.959963984540054
#: Resamples of the percentile bootstrap (fixed seed).
BOOTSTRAP = 2000


def wilson(k: int, n: int, z: float = Z95) -> list[float]:
    """Wilson score interval ``[lo, hi]`` of ``k`` successes in ``n`` trials."""
    if n <= 0 or not 0 <= k <= n:
        raise ValueError(f"need 0 <= k <= n and n > 0, got k={k}, n={n}")
    p = k / n
    den = 1 + z * z / n
    mid = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return [max(0.0, mid - half), min(1.0, mid + half)]


def mean_ci95(values) -> list[float]:
    """95% percentile-bootstrap interval of the mean (seeded: reproducible)."""
    x = np.asarray(values, dtype=np.float64)
    if x.size == 0:
        raise ValueError("no values")
    means = np.random.default_rng(0).choice(x, size=(BOOTSTRAP, x.size)).mean(axis=1)
    lo, hi = np.quantile(means, [0.025, 0.975])
    return [float(lo), float(hi)]


def mcnemar_p(a: list[bool], b: list[bool]) -> float:
    """Exact two-sided McNemar p-value of paired outcomes ``a`` and ``b`` (1.0 when they
    never disagree)."""
    if len(a) != len(b):
        raise ValueError(f"paired lists of unequal length: {len(a)} and {len(b)}")
    only_a = sum(1 for x, y in zip(a, b, strict=True) if x and not y)
    only_b = sum(1 for x, y in zip(a, b, strict=True) if y and not x)
    n = only_a + only_b
    if n == 0:
        return 1.0
    k = min(only_a, only_b)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2**n
    return min(1.0, 2 * tail)


def disjoint(a: list[float], b: list[float]) -> bool:
    """True when two intervals do not overlap."""
    return a[1] < b[0] or b[1] < a[0]
