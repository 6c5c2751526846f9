"""Orthonormal rotations used by the formats (applied per KV head, along head_dim)."""

from __future__ import annotations

import functools

import torch


@functools.cache
def hadamard(d: int) -> torch.Tensor:
    """Normalised Sylvester Hadamard matrix ``[d, d]`` (float32, symmetric, ``H @ H = I``)."""
    if d <= 0 or d & (d - 1):
        raise ValueError(f"Hadamard rotation needs head_dim a power of two, got {d}")
    h = torch.ones(1, 1)
    while h.shape[0] < d:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h / d**0.5


@functools.cache
def random_orthogonal(d: int, seed: int = 0) -> torch.Tensor:
    """A fixed random orthogonal matrix ``[d, d]`` (float32), from a seeded QR."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(d, d, generator=g, dtype=torch.float64)
    q, r = torch.linalg.qr(a)
    q = q * torch.sign(torch.diagonal(r))  # make the factorisation unique
    return q.to(torch.float32)


def rotate(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """``x @ m`` along the last axis, in float32."""
    return x.to(torch.float32) @ m
