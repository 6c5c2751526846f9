"""Helpers for tests and benchmarks: a synthetic calibration for the compact formats."""

from __future__ import annotations

import torch

from kvzip_formats.calibration import Calibration


def synthetic_calibration(
    num_kv_heads: int,
    head_dim: int,
    num_layers: int = 1,
    seed: int = 0,
    num_q_heads: int | None = None,
) -> Calibration:
    """Random but valid channel statistics (means, variances, weights) for every layer: the
    compact formats' transforms are then full d x d maps, as on a real model."""
    g = torch.Generator().manual_seed(seed)
    shape = (num_layers, num_kv_heads, head_dim)
    tensors = {}
    for kind in "kv":
        tensors[f"{kind}_mean"] = torch.randn(*shape, generator=g)
        tensors[f"{kind}_var"] = torch.rand(*shape, generator=g) * 2 + 0.1
        tensors[f"{kind}_weight"] = torch.rand(*shape, generator=g) + 0.05
    model = dict(
        name="synthetic",
        identity=f"synthetic-{seed}",
        num_layers=num_layers,
        num_kv_heads=num_kv_heads,
        num_q_heads=num_q_heads or 4 * num_kv_heads,
        head_dim=head_dim,
    )
    return Calibration(model=model, tensors=tensors)
