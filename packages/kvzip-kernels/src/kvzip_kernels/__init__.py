"""kvzip_kernels: Triton paged cache-write and decode attention for kvzip's cache formats."""

from kvzip_kernels._merge_extra import Ring, ring_write, window_row_end
from kvzip_kernels._version import __version__
from kvzip_kernels.cache_write import cache_write
from kvzip_kernels.paged_decode import DecodeConfig, paged_decode

__all__ = [
    "DecodeConfig",
    "Ring",
    "__version__",
    "cache_write",
    "paged_decode",
    "ring_write",
    "window_row_end",
]
