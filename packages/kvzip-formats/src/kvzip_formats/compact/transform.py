"""The calibrated linear transform of the compact formats, per layer, KV head and K/V.

Encode maps a vector ``x`` (one token, one KV head) to ``y = A (x - mu)``; decode maps back
with ``x^ = B y^ + mu`` where ``B = A^-1``. ``A = blockdiag(H_g) P diag(a * gamma)``:

* ``mu``: the calibrated channel mean. For K it is exact to drop (``q . mu`` is the same for
  every key of a query, so softmax ignores it): the keys carry a large constant per-channel
  offset (|mean| / mean norm 0.64-0.80 per layer on SmolLM2) that otherwise eats the grid.
  For V, attention adds ``mu`` back once per output (the probabilities sum to 1).
* ``a = (w / var) ** 0.25``: smoothing. An error ``e`` in K changes a score by ``q . e``, so
  channel j's error counts with weight ``w_j = E[q_j^2]`` (summed over the group's query
  heads); for V the weight is the squared norm of the ``o_proj`` columns channel j feeds.
  With a rotation spreading each group's error evenly over its channels, the weighted error
  is least when ``a_j^2`` is proportional to ``sqrt(w_j / var_j)`` (Cauchy-Schwarz), i.e.
  SmoothQuant's alpha = 0.5 applied to the error metric. Folded into the query at decode.
* ``P``: channels sorted by importance ``sqrt(w_j var_j)``, descending, so that groups of
  consecutive transformed channels can get different bit widths (the widest group first).
* ``gamma``: per group, scales so the group's mean square per channel is 1 on calibration
  data: one token scale then serves every group.
* ``H_g``: the normalised Sylvester-Hadamard matrix of the group's size, which makes each
  transformed channel close to Gaussian and spreads outliers, matching the Gaussian codebook.

All derivation runs in float64 from the calibration's float32 statistics and is rounded to
float32 once; B is built in closed form (``H`` is orthonormal and symmetric), not inverted.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvzip_formats.rotation import hadamard

#: Variances and weights below this share of the head's largest are raised to it, so that a
#: dead channel (variance 0) cannot make ``a`` infinite.
FLOOR = 1e-6


@dataclass(frozen=True)
class Transform:
    """Per KV head: ``mean [H, d]``, ``encode A [H, d, d]``, ``decode B [H, d, d]`` (float32)."""

    mean: torch.Tensor
    encode: torch.Tensor
    decode: torch.Tensor


def derive(
    mean: torch.Tensor, var: torch.Tensor, weight: torch.Tensor, groups, *, rotate: bool = True
) -> Transform:
    """Build the transform of one layer and kind from calibration statistics ``[H, d]``.

    ``groups`` is the row layout's ``((channels, bits), ...)`` in transformed order.
    ``rotate=False`` (identity instead of ``H_g``) exists for the ablation only.
    """
    mean, var, weight = (t.double() for t in (mean, var, weight))
    H, d = var.shape
    var = torch.maximum(var, var.amax(-1, keepdim=True) * FLOOR).clamp_min(1e-30)
    weight = torch.maximum(weight, weight.amax(-1, keepdim=True) * FLOOR).clamp_min(1e-30)
    a = (weight / var) ** 0.25
    importance = (weight * var).sqrt()
    enc = torch.zeros(H, d, d, dtype=torch.float64)
    dec = torch.zeros(H, d, d, dtype=torch.float64)
    for h in range(H):
        perm = torch.sort(-importance[h], stable=True).indices
        start = 0
        for n, _bits in groups:
            idx = perm[start : start + n]
            gamma = 1.0 / (a[h, idx] ** 2 * var[h, idx]).mean().sqrt()
            scale = a[h, idx] * gamma
            rot = hadamard(n).double() if rotate else torch.eye(n, dtype=torch.float64)
            enc[h, start : start + n, idx] = rot * scale[None, :]
            dec[h, idx, start : start + n] = rot.T / scale[:, None]
            start += n
    return Transform(mean.float(), enc.float(), dec.float())


def apply(x: torch.Tensor, t: Transform) -> torch.Tensor:
    """``[T, H, d]`` -> ``y = A (x - mean)`` per head, float32 (float64 math, rounded once)."""
    return torch.einsum("thd,hed->the", x.double() - t.mean.double(), t.encode.double()).float()


def unapply(y: torch.Tensor, t: Transform) -> torch.Tensor:
    """``[T, H, d]`` -> ``B y + mean`` per head, float32."""
    return torch.einsum("the,hde->thd", y.float(), t.decode) + t.mean
