"""The tile checksum of spec/blob.md section 6: the one reference implementation.

``checksum = sum_p fmix32((p * 0x9E3779B1 + v_p) mod 2^32) mod 2^32`` over a tile's decoded
values ``v_p`` (``p``: row-major index in the tile). Written with integer operators only, on
int64 holding uint32s, so the same functions run on numpy arrays (the CPU coders) and on torch
tensors (the GPU paths' raw tiles and escapes); the kernels (``csrc/kvzl.cu``, ``gpu.py``'s
Triton kernels, ``_cpu_fast.py``) inline the same arithmetic and are tested against this.
Depends on nothing (imported by every coder).
"""

from __future__ import annotations

GOLDEN = 0x9E3779B1
M1, M2 = 0x85EBCA6B, 0xC2B2AE35
MASK = 0xFFFFFFFF


def fmix32(h):
    """MurmurHash3's 32-bit finaliser of int64 ``h`` (numpy array or torch tensor), mod 2^32.
    Products of two values < 2^32 wrap in int64; their low 32 bits, kept by the mask, are
    exact."""
    h = h & MASK
    h = h ^ (h >> 16)
    h = (h * M1) & MASK
    h = h ^ (h >> 13)
    h = (h * M2) & MASK
    return h ^ (h >> 16)


def value_hashes(p, v):
    """Per-value terms ``fmix32(p * GOLDEN + v)`` for int64 positions ``p`` and values ``v``
    (bf16 bit patterns, any integer dtype widened to int64 by the caller)."""
    return fmix32(p * GOLDEN + (v & 0xFFFF))


def tile_checksums(vals):
    """Checksums (uint32 numpy) of tiles ``vals[..., n]`` (uint16 bit patterns)."""
    import numpy as np

    v = np.asarray(vals).astype(np.int64)
    p = np.arange(v.shape[-1], dtype=np.int64)
    return (value_hashes(p, v).sum(-1) & MASK).astype(np.uint32)


def partial_sum(positions, vals) -> int:
    """The share (a Python int, mod 2^32) of the values ``vals`` at tile positions
    ``positions`` in their tile's checksum (numpy int arrays)."""
    import numpy as np

    p = np.asarray(positions).astype(np.int64)
    return int(value_hashes(p, np.asarray(vals).astype(np.int64)).sum() & MASK)
