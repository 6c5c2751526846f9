"""kvzip_kernels: Triton and CUDA paged cache-write and decode attention for kvzip's formats.

Decode attention is planned once per forward step and run per layer (``decode_plan.py``:
:func:`plan`, :class:`DecodePlan`, :func:`supports`); :func:`paged_decode` is one plan and one
run.
"""

from kvzip_kernels._merge_extra import Ring, SinkSlots, ring_write, window_row_end
from kvzip_kernels._version import __version__
from kvzip_kernels.cache_write import cache_write
from kvzip_kernels.decode_plan import DecodeConfig, DecodePlan, plan, refusal, supports
from kvzip_kernels.paged_decode import paged_decode

__all__ = [
    "DecodeConfig",
    "DecodePlan",
    "Ring",
    "SinkSlots",
    "__version__",
    "cache_write",
    "paged_decode",
    "plan",
    "refusal",
    "ring_write",
    "supports",
    "window_row_end",
]
