"""Bit packing shared by the reference codecs (little-endian throughout)."""

from __future__ import annotations

import torch


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """``[..., 2n]`` integer codes in 0..15 -> ``[..., n]`` uint8; element 2i in the low nibble."""
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_nibbles`: ``[..., n]`` uint8 -> ``[..., 2n]`` uint8 codes."""
    lo = packed & 0x0F
    hi = packed >> 4
    return torch.stack((lo, hi), dim=-1).flatten(-2)


def f16_to_bytes(x: torch.Tensor) -> torch.Tensor:
    """``[...]`` float16 -> ``[..., 2]`` uint8 (little-endian)."""
    return x.to(torch.float16).contiguous().view(torch.uint8).reshape(*x.shape, 2)


def bytes_to_f16(b: torch.Tensor) -> torch.Tensor:
    """``[..., 2]`` uint8 -> ``[...]`` float16."""
    return b.contiguous().view(torch.float16).squeeze(-1)
